"""``kvbridge up --engines`` as a user runs it, in secure mode as the docs say: one keys file (a tenant key and
one service key holding the gateway, engine and operator roles) and that service key in KVBRIDGE_API_KEY. A real
stack and two real vLLM CPU engines with the kvbridge connector (they register themselves); a multi-turn
conversation through the OpenAI SDK with the tenant key reuses KV on a later turn; no component logs
UNAUTHENTICATED (issue 15: the gateway used to send no key to the registry, the registry none to the lease
manager); then Ctrl-C (SIGINT) and nothing of that run is left behind.

One test, one pair of engines: the pair takes a minute to start on this machine, and the secure run covers
the plain one's checks. Starts its own engines (not the shared pool): the pool is closed first so only one pair
spins the cores.
"""

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

from tests.fixtures.cli_proc import wait_for_output
from tests.fixtures.common import CONNECTOR_HINT, DEV_HINT, free_port, require
from tests.fixtures.vllm_engines import EnginePool

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 15 * 60  # engines take 45-60 s alone; far longer beside other CPU-heavy work
TENANT_KEY, SERVICE_KEY = "kvb_e2e_tenant", "kvb_e2e_service"

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


def test_up_engines_secure_answers_a_conversation_reusing_kv_and_sigint_leaves_no_engine(
    tmp_path: Path, engine_pool: EnginePool
) -> None:
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
        assert re.search(r"waiting for .*\(\d+s\)", progress), "no elapsed-time progress while engines started"
        groups = _engine_groups(progress)
        assert len(groups) == 2, progress
        printed = out.read_text()
        assert f"curl -s http://127.0.0.1:{http_port}/v1/chat/completions" in printed
        registry = re.search(r"^registry: (\S+)$", printed, re.MULTILINE)
        assert registry is not None

        # The connector registered both engines itself (nothing else registers in this stack); the operator
        # reads them with the service key.
        listed = subprocess.run(
            [sys.executable, "-m", "kvbridge_services.cli", "engines", "ls", "--json", "--registry", registry.group(1)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert listed.returncode == 0, listed.stderr
        roles = sorted(e["role"] for e in json.loads(listed.stdout))
        assert roles == ["ENGINE_ROLE_DECODE", "ENGINE_ROLE_PREFILL"]

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
            assert reply.choices[0].finish_reason in ("stop", "length")
            verdicts.append(raw.headers["x-kvbridge-reuse"])
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"and then w{turn} w{turn + 1} w{turn + 2}"},
            ]
            time.sleep(2)  # D registers the turn's entry after the response
        assert verdicts[0].startswith("miss"), verdicts
        assert any(v.startswith("hit") for v in verdicts[1:]), verdicts
        running = _leftovers(groups, str(engines_dir))
        assert len(running) > 2, f"expected engine servers and their children, found {running}"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 0, err.read_text()[-5000:]
        assert "stopped" in err.read_text()
        assert _leftovers(groups, str(engines_dir)) == [], "vLLM processes of this run survived Ctrl-C"
        for path in [err, out, *sorted((engines_dir / "logs").glob("*"))]:
            text = path.read_text(errors="replace")
            assert not re.search("UNAUTHENTICATED", text), f"{path}: {text[-3000:]}"
        print("reuse verdicts:", verdicts)
    finally:
        groups |= _engine_groups(err.read_text(errors="replace"))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _leftovers(groups, str(engines_dir)):  # never leave engines spinning the cores
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
