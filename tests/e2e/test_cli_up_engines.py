"""``kvbridge up --engines`` as a user runs it: a real stack, two real vLLM CPU engines with the kvbridge
connector (they register themselves), one chat turn through the gateway, then Ctrl-C (SIGINT) and nothing
of that run left behind.

Starts its own engines (not the shared pool): the pool is closed first so only one pair spins the cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fixtures.cli_proc import wait_for_output
from tests.fixtures.common import CONNECTOR_HINT, free_port, require
from tests.fixtures.vllm_engines import EnginePool

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 15 * 60  # engines take 45-60 s alone; far longer beside other CPU-heavy work

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 600)]


def _leftovers(engine_groups: set[int], marker: str) -> list[int]:
    """Live (non-zombie) processes in one of the engines' process groups or naming this run's engines dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if state != "Z" and (int(pgrp) in engine_groups or marker in cmdline):
            found.append(int(entry.name))
    return found


def _engine_groups(progress: str) -> set[int]:
    """Each engine leads its own process group (its pid), holding its engine-core/worker children."""
    return {int(pid) for pid in re.findall(r"engine starting: \S+ \(pid (\d+),", progress)}


def test_up_engines_answers_a_chat_turn_and_sigint_leaves_no_engine(tmp_path: Path, engine_pool: EnginePool) -> None:
    require("kvbridge_connector", CONNECTOR_HINT)
    engine_pool.close()  # this machine fits one pair of engines
    engines_dir = tmp_path / "kvbridge-engines"
    http_port = free_port()
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
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=REPO, start_new_session=True)
    groups: set[int] = set()
    try:
        progress = wait_for_output(err, "stack is up", proc, START_TIMEOUT_S + 120)
        assert re.search(r"waiting for .*\(\d+s\)", progress), "no elapsed-time progress while engines started"
        printed = out.read_text()
        assert f"curl -s http://127.0.0.1:{http_port}/v1/chat/completions" in printed
        registry = re.search(r"^registry: (\S+)$", printed, re.MULTILINE)
        assert registry is not None

        # The connector registered both engines itself (nothing else registers in this stack).
        listed = subprocess.run(
            [sys.executable, "-m", "kvbridge_services.cli", "engines", "ls", "--json", "--registry", registry.group(1)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        roles = sorted(e["role"] for e in json.loads(listed.stdout))
        assert roles == ["ENGINE_ROLE_DECODE", "ENGINE_ROLE_PREFILL"]

        body = {
            "model": "tiny",
            "conversation_id": "cli-e2e",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "w1 w2 w3 w4 w5"}],
        }
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert reply.headers["x-kvbridge-reuse"].startswith("miss")
        groups = _engine_groups(progress)
        assert len(groups) == 2, progress
        running = _leftovers(groups, str(engines_dir))
        assert len(running) > 2, f"expected engine servers and their children, found {running}"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 0, err.read_text()[-5000:]
        assert "stopped" in err.read_text()
        assert _leftovers(groups, str(engines_dir)) == [], "vLLM processes of this run survived Ctrl-C"
    finally:
        groups |= _engine_groups(err.read_text(errors="replace"))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _leftovers(groups, str(engines_dir)):  # never leave engines spinning the cores
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
