"""README command 1 as a user runs it: ``kvbridge demo --json`` with two real vLLM CPU engines (the demo model
shape), secure mode with a generated keys file, an agent conversation through the OpenAI SDK; the report
shows reuse where it must and nowhere else, both TTFTs of every turn, the PNG, and no engine left behind.

Starts its own engines (not the shared pool): the pool is closed first so only one pair spins the cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_up_engines import _engine_groups, _leftovers
from tests.fixtures.common import CONNECTOR_HINT, require
from tests.fixtures.vllm_engines import EnginePool

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 20 * 60  # about 4 min alone; far longer beside other CPU-heavy work

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 120)]


def test_demo_json_reports_reuse_verdicts_ttfts_and_a_png(tmp_path: Path, engine_pool: EnginePool) -> None:
    require("kvbridge_connector", CONNECTOR_HINT)
    engine_pool.close()  # this machine fits one pair of engines
    engines_dir, png = tmp_path / "engines", tmp_path / "ttft.png"
    command = [
        sys.executable,
        "-m",
        "kvbridge_services.cli",
        "demo",
        "--json",
        "--engines-dir",
        str(engines_dir),
        "--png",
        str(png),
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True, start_new_session=True
    )
    out, err = "", ""
    try:
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # the demo stops its engines' process groups itself
            out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _leftovers(_engine_groups(err), str(engines_dir)):  # never leave engines spinning the cores
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-6000:]
    assert "healthy after" in err and "secure mode: keys file" in err, err[-3000:]
    report = json.loads(out)
    turns = {t["turn"].split(" ")[0]: t for t in report["turns"]}
    print(json.dumps(report, indent=1))
    assert sorted(turns) == ["1", "2", "3", "4", "5", "6"]
    for t in report["turns"]:
        assert t["context_tokens"] > 0 and t["ttft_reuse_ms"] > 0 and t["ttft_cold_ms"] > 0, t
        assert t["cold_verdict"] == "miss", t  # the baseline had nothing to reuse
    assert turns["1"]["verdict"] == "miss" and turns["1"]["pulled_tokens"] == 0
    # Append-only turns pull everything D retained of the previous turn (whole 32-token blocks); turn 2
    # came after a tool pause longer than D's entry lease: the SDK heartbeat kept the KV.
    for n, previous in (("2", "1"), ("3", "2")):
        t = turns[n]
        assert t["verdict"] == "hit", t
        assert t["pulled_tokens"] % 32 == 0
        assert turns[previous]["context_tokens"] - 32 < t["pulled_tokens"] < t["context_tokens"], (t, previous)
    assert turns["2"]["paused_s"] > 6 and turns["2"]["heartbeat_rounds"] >= 2, turns["2"]
    # The stripped hotel output: verified only up to it (past turn 2's context, short of turn 3's).
    stripped = turns["4"]
    assert stripped["verdict"] == "hit", stripped
    assert turns["2"]["context_tokens"] - 32 < stripped["pulled_tokens"] < turns["3"]["context_tokens"] - 64
    assert turns["5"]["tenant"] == "globex" and turns["5"]["verdict"] == "miss" and turns["5"]["pulled_tokens"] == 0
    fork = turns["6"]
    assert fork["conversation"] == "" and fork["verdict"] == "hit", fork
    assert 0 < fork["pulled_tokens"] < fork["context_tokens"]
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["png"] == str(png)
    groups = _engine_groups(err)
    assert len(groups) == 2, err[-3000:]
    assert _leftovers(groups, str(engines_dir)) == [], "vLLM processes of the demo survived it"
