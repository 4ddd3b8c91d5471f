"""``kvbridge up`` with stock engines given by URL alone (ADR 0027): it prints what the gateway routes to (URL, role,
model, mode, registered or not), and an engine that does not state what its registration needs stops the start with
one line naming the fields (exit 1)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from tests.fixtures.cli_proc import wait_for_output
from tests.fixtures.common import free_port

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def sim(role: str, *flags: str) -> Iterator[str]:
    """An engine simulator process (a stock vLLM stand-in); its URL once it answers /health."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tools.engine_sim", "--role", role, "--port", str(port), *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the engine simulator did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def up(p: str, d: str, stdout: Path, stderr: Path) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env = {**clean, "KVBRIDGE_GATEWAY_PREFILL_ENGINES": p, "KVBRIDGE_GATEWAY_DECODE_ENGINES": d}
    ports = ["--registry-port", "0", "--lease-port", "0", "--gateway-http-port", "0", "--gateway-grpc-port", "0"]
    with stdout.open("wb") as out, stderr.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "kvbridge_services.cli", "up", *ports], stdout=out, stderr=err, cwd=REPO, env=env
        )


def test_up_prints_each_engine_it_routes_to_and_that_the_gateway_registered_it(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with sim("prefill", "--block-size", "32") as p, sim("decode", "--block-size", "32") as d:
        proc = up(p, d, out, err)
        try:
            wait_for_output(err, "stack is up", proc, 120)
            printed = out.read_text()
            assert "gateway routes to:\n" in printed, printed
            for role, url in (("prefill", p), ("decode", d)):
                line = re.escape(f"  {role} {url}: model sim-model, compatibility mode, registered by this gateway")
                assert re.search(rf"^{line} \(engine id sim-[0-9a-f]{{8}}, block size 32\)$", printed, re.MULTILINE), (
                    printed
                )
            assert "no engine" not in printed
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, err.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_up_stops_with_one_line_naming_what_an_engine_does_not_state(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with sim("prefill") as p, sim("decode", "--no-cache-config-info") as d:
        proc = up(p, d, out, err)
        try:
            # A configuration the engines cannot serve: exit 2 (docs/settings.md, "Failures to start").
            assert proc.wait(timeout=120) == 2
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [line for line in err.read_text().splitlines() if line.startswith("kvbridge: up: ")]
    assert failed == [
        f"kvbridge: up: invalid configuration: engine {d} (decode) cannot be registered for reuse: block_size not"
        f" stated by the engine (its /metrics has no vllm:cache_config_info with a block_size: --disable-log-stats?);"
        " set it in"
        f' KVBRIDGE_GATEWAY_DECODE_ENGINES ({{"url": "{d}", "block_size": ...}}), or "register_in_registry": false'
        " (or KVBRIDGE_GATEWAY_REGISTER_STATIC_ENGINES=false) to route it without reuse"
    ], err.read_text()
    assert "Traceback" not in err.read_text()
