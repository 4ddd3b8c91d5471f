"""``kvbridge up`` refuses an insecure or inconsistent configuration at start, with one line naming the
setting and exit status 2, a configuration error (not a traceback, not a stack that runs open)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _up(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge_services.cli",
            "up",
            "--registry-port",
            "0",
            "--lease-port",
            "0",
            "--gateway-http-port",
            "0",
            "--gateway-grpc-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


def test_up_without_keys_refuses_a_public_address() -> None:
    done = _up({"KVBRIDGE_HOST": "0.0.0.0"})
    assert done.returncode == 2, done.stderr
    assert "refusing to listen on '0.0.0.0' without API keys" in done.stderr and "KVBRIDGE_INSECURE=1" in done.stderr
    assert "Traceback" not in done.stderr


def test_up_with_keys_needs_the_deployment_secret(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"kvb_svc": {"name": "stack", "roles": ["gateway", "engine", "operator"]}}))
    done = _up({"KVBRIDGE_API_KEYS_FILE": str(keys), "KVBRIDGE_API_KEY": "kvb_svc"})
    assert done.returncode == 2, done.stderr
    assert "KVBRIDGE_HASH_SECRET is required" in done.stderr and "Traceback" not in done.stderr
    done = _up({"KVBRIDGE_API_KEYS_FILE": str(keys), "KVBRIDGE_HASH_SECRET": "not-hex-at-all"})
    assert done.returncode == 2 and "KVBRIDGE_HASH_SECRET must be hex" in done.stderr, done.stderr
