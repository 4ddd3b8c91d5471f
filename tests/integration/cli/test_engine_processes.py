"""The dev-engine launcher's process handling, on stand-in processes (no vLLM): health polling through
real HTTP, failure reports with the log tail, and stopping a whole process group (children included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge_services.devengines.launcher import Engine, EngineSpec, HealthWatch, free_port, group_alive, stop_engine


def _engine(tmp_path: Path, name: str, argv: list[str], port: int = 0) -> Engine:
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    spec = EngineSpec(name, "kv_consumer", tmp_path, tmp_path)
    return Engine(spec, port or free_port(), 0, name, proc, log_path)


def _poll_until_done(watch: HealthWatch, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not watch.poll():
        assert time.monotonic() < deadline, "never healthy"
        time.sleep(0.2)


def test_health_watch_reports_progress_then_healthy(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")  # http.server answers GET /health with 200
    port = free_port()
    engine = _engine(tmp_path, "decode", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port)
    messages: list[str] = []
    try:
        watch = HealthWatch([engine], 60, progress=messages.append, report_every_s=0)
        _poll_until_done(watch, 60)
        assert messages[-1].startswith("decode healthy after ")
    finally:
        stop_engine(engine, grace_s=5)


def test_health_watch_raises_with_the_log_tail_when_an_engine_exits(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "prefill", [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"])
    engine.process.wait(timeout=30)
    with pytest.raises(RuntimeError, match=r"(?s)prefill exited with 3:.*boom: no model"):
        HealthWatch([engine], 60, progress=lambda _m: None).poll()


def test_health_watch_times_out_naming_the_engine(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "decode", [sys.executable, "-c", "import time; print('still loading'); time.sleep(60)"])
    try:
        watch = HealthWatch([engine], 0.01, progress=lambda _m: None)
        time.sleep(0.05)
        with pytest.raises(TimeoutError, match=r"(?s)not healthy after .*--- decode"):
            watch.poll()
    finally:
        stop_engine(engine, grace_s=5)


def test_stop_engine_kills_the_whole_group_even_children_that_ignore_sigterm(tmp_path: Path) -> None:
    # A parent with a child that ignores SIGTERM (an engine core stuck in a kernel): SIGKILL after the grace.
    child = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child', flush=True); "
        "time.sleep(300)"
    )
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(300)"
    engine = _engine(tmp_path, "decode", [sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while "child" not in engine.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_alive(engine.process.pid)
    stop_engine(engine, grace_s=1)
    assert engine.process.poll() is not None
    deadline = time.monotonic() + 10  # the killed orphan stays a zombie until init reaps it
    while group_alive(engine.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(engine.process.pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(engine.process.pid, signal.SIGTERM)
