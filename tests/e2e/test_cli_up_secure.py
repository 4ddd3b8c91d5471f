"""``kvbridge up --engines`` in secure mode as the docs say to run it: one keys file (a tenant key and one
service key holding the gateway, engine and operator roles) and one service key in KVBRIDGE_API_KEY. A
multi-turn conversation through the OpenAI SDK with the tenant key reuses KV on its second turn, and no
component logs UNAUTHENTICATED (issue 15: the gateway used to send no key to the registry, the registry none
to the lease manager)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli_up_engines import START_TIMEOUT_S, _engine_groups, _leftovers
from tests.fixtures.cli_proc import wait_for_output
from tests.fixtures.common import CONNECTOR_HINT, DEV_HINT, free_port, require
from tests.fixtures.vllm_engines import EnginePool

REPO = Path(__file__).resolve().parents[2]
TENANT_KEY, SERVICE_KEY = "kvb_e2e_tenant", "kvb_e2e_service"

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 600)]


def test_up_engines_secure_with_one_keys_file_and_one_service_key(tmp_path: Path, engine_pool: EnginePool) -> None:
    require("kvbridge_connector", CONNECTOR_HINT)
    openai = require("openai", DEV_HINT)

    engine_pool.close()  # this machine fits one pair of engines
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                TENANT_KEY: {"name": "acme-app", "role": "tenant", "tenant": "acme"},
                SERVICE_KEY: {"name": "stack", "roles": ["gateway", "engine", "operator"]},
            }
        )
    )
    engines_dir = tmp_path / "kvbridge-engines"
    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env.update(KVBRIDGE_API_KEYS_FILE=str(keys), KVBRIDGE_API_KEY=SERVICE_KEY)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    command = [
        sys.executable,
        "-m",
        "kvbridge_services.cli",
        "up",
        "--engines",
        "--engines-dir",
        str(engines_dir),
        "--engine-start-timeout",
        str(START_TIMEOUT_S),
        "--registry-port",
        "0",
        "--lease-port",
        "0",
        "--gateway-http-port",
        str(http_port),
        "--gateway-grpc-port",
        "0",
    ]
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=REPO, env=env, start_new_session=True)
    groups: set[int] = set()
    try:
        progress = wait_for_output(err, "stack is up", proc, START_TIMEOUT_S + 120)
        groups = _engine_groups(progress)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key=TENANT_KEY, timeout=600, max_retries=0
        )
        messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(1, 200))}]
        verdicts = []
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=messages,
                max_tokens=8,
                temperature=0,
                extra_body={"conversation_id": "secure-e2e"},
            )
            reply = raw.parse()
            verdicts.append(raw.headers["x-kvbridge-reuse"])
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"and then w{turn} w{turn + 1} w{turn + 2}"},
            ]
            time.sleep(2)  # D registers the turn's entry after the response
        assert verdicts[0].startswith("miss"), verdicts
        assert any(v.startswith("hit") for v in verdicts[1:]), verdicts

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 0, err.read_text()[-5000:]
        logs = [err, out, *sorted((engines_dir / "logs").glob("*"))]
        for path in logs:
            text = path.read_text(errors="replace")
            assert not re.search("UNAUTHENTICATED", text), f"{path}: {text[-3000:]}"
        print("reuse verdicts:", verdicts)
    finally:
        groups |= _engine_groups(err.read_text(errors="replace"))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _leftovers(groups, str(engines_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
