"""``kvbridge bench`` (the real bench scripts) and ``kvbridge up`` (the real stack, stopped by SIGINT)."""

from __future__ import annotations

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
from tests.fixtures.common import free_port, require_etcd_binary

from kvbridge_services.cli import BENCHES

REPO = Path(__file__).resolve().parents[3]


def _run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge_services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=REPO,
    )


def test_bench_help_lists_every_bench_script_with_a_description() -> None:
    result = _run("bench", "--help", timeout=30)
    assert result.returncode == 0, result.stderr
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    assert {script for script, _ in BENCHES.values()} == scripts, "a bench script is missing from kvbridge bench"
    for name, (script, description) in BENCHES.items():
        line = next(line for line in result.stdout.splitlines() if line.strip().startswith(name + " "))
        assert script in line and description in line


@pytest.mark.etcd
def test_bench_registry_runs_the_script_with_the_given_arguments() -> None:
    require_etcd_binary()  # the registry bench also measures a local etcd
    args = ["--registrations", "20", "--lookups", "40", "--client-procs", "1"]
    result = _run("bench", "registry", "--", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "registry_bench.py " + " ".join(args) in result.stderr
    # The script's report, for both of the backends it measures.
    assert "| embedded (MemoryStore) |" in result.stdout and "| etcd 3.4" in result.stdout, result.stdout


def test_bench_passes_the_scripts_exit_code_and_errors_through() -> None:
    result = _run("bench", "registry", "--", "--no-such-flag", timeout=60)
    assert result.returncode == 2
    assert "registry_bench.py: error: unrecognized arguments: --no-such-flag" in result.stderr


def test_bench_unknown_name_exits_2_naming_the_choices() -> None:
    result = _run("bench", "nope", timeout=30)
    assert result.returncode == 2
    assert "invalid choice: 'nope'" in result.stderr and "registry" in result.stderr


def test_bench_without_a_source_checkout_says_so(tmp_path: Path) -> None:
    result = _run("bench", "lease", env=dict(os.environ, KVBRIDGE_BENCH_DIR=str(tmp_path)), timeout=30)
    assert result.returncode == 1
    assert f"{tmp_path / 'lease_bench.py'} not found" in result.stderr and "source checkout" in result.stderr


def test_up_help_documents_engines() -> None:
    result = _run("up", "--help", timeout=30)
    assert result.returncode == 0
    for text in ("--engines", "--engines-dir", "--engine-start-timeout", "prefill", "decode", "Ctrl-C", "exit codes"):
        assert text in result.stdout, text


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_up_rejects_a_bad_engine_start_timeout(value: str) -> None:
    result = _run("up", "--engines", "--engine-start-timeout", value, timeout=30)
    assert result.returncode == 2
    assert "--engine-start-timeout" in result.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_until_ctrl_c_or_sigterm_then_exits_0(tmp_path: Path, stop_signal: signal.Signals) -> None:
    http_port = free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
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
                str(http_port),
                "--gateway-grpc-port",
                "0",
            ],
            stdout=stdout,
            stderr=stderr,
            cwd=REPO,
        )
    try:
        wait_for_output(err, "stack is up", proc, 120)
        printed = out.read_text()
        assert f"gateway: http://127.0.0.1:{http_port}" in printed
        addresses = dict(re.findall(r"^(registry|lease manager): (\S+)$", printed, re.MULTILINE))
        assert httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=10).status_code == 200
        status = _run(
            "status",
            "--registry",
            addresses["registry"],
            "--lease",
            addresses["lease manager"],
            "--tenant",
            "acme",
            "--json",
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout) == {
            "registry": addresses["registry"],
            "lease": addresses["lease manager"],
            "engines": 0,
            "tenant": "acme",
            "entries": 0,
            "leases": 0,
        }
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=60) == 0, err.read_text()
        assert "stopped" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
