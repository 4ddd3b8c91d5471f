"""The kvbridge command line, through real processes and the real in-process stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge_services.cli import build_parser


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge_services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_control_plane_only_reports_reuse_per_turn_and_isolation() -> None:
    result = _run("demo", "--control-plane-only", "--json")
    assert result.returncode == 0, result.stderr
    turns = {t["turn"]: t for t in json.loads(result.stdout)}
    assert turns["turn 1"]["verdict"] == "not_found"
    for label in ("turn 2", "turn 3"):
        t = turns[label]
        assert t["verdict"] == "hit"
        assert 0 < t["reused_tokens"] < t["prompt_tokens"]
        assert t["reused_tokens"] % 32 == 0
    stripped = turns["turn 4 (reasoning stripped)"]
    assert stripped["verdict"] == "hit"
    assert stripped["reused_tokens"] < turns["turn 3"]["reused_tokens"] + 32
    assert turns["other tenant, same key"]["reused_tokens"] == 0
    assert turns["new conversation, shared prefix"]["verdict"] == "hit"
    assert turns["after close"]["verdict"] != "hit"


@pytest.mark.parametrize(
    "argv",
    [["conversations", "show"], ["leases", "revoke"], ["leases", "revoke", "-3"], ["engines", "rm"], ["nope"]],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str]) -> None:
    result = _run(*argv, timeout=30)
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_service_errors_exit_1_with_the_reason() -> None:
    # Nothing listens on port 1: UNAVAILABLE after the retries, a clear message, exit 1.
    result = _run("engines", "ls", "--registry", "127.0.0.1:1", "--timeout", "0.2", timeout=60)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_every_command_has_help() -> None:
    parser = build_parser()
    for cmd in ("up", "demo", "status", "engines", "conversations", "leases", "bench"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([cmd, "--help"])
        assert exc.value.code == 0
