"""The three service entry points behave one way (kvbridge_services.common.entrypoint): the same flags for the
same things, every setting in --help, a bad setting or flag as one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SERVICES = {
    "registry": ["--host", "--port", "--data-dir"],
    "lease": ["--host", "--port", "--data-dir"],
    "gateway": ["--host", "--http-port", "--grpc-port"],
}
# A setting of each service that its validation refuses.
BAD_SETTING = {
    "registry": {"KVBRIDGE_REGISTRY_PORT": "not-a-port"},
    "lease": {"KVBRIDGE_LEASE_PORT": "70000"},
    "gateway": {"KVBRIDGE_GATEWAY_HTTP_PORT": "-1"},
}


def _run(service: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", f"kvbridge_services.{service}", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("service", SERVICES)
def test_help_lists_the_shared_flags_every_setting_and_telemetry(service: str) -> None:
    done = _run(service, "--help")
    assert done.returncode == 0, done.stderr
    for flag in SERVICES[service]:
        assert f"  {flag} " in done.stdout, flag
    assert f"python -m kvbridge_services.{service}" in done.stdout
    assert "_LOG_LEVEL  (default INFO)" in done.stdout and "OTEL_EXPORTER_OTLP_ENDPOINT" in done.stdout
    assert f"(default kvbridge-{service})" in done.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_setting_is_one_line_and_exit_code_2(service: str) -> None:
    done = _run(service, env=BAD_SETTING[service])
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("invalid configuration: "), done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert next(iter(BAD_SETTING[service])) in done.stderr  # named as the environment names it


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_flag_is_refused_before_anything_starts(service: str) -> None:
    port_flag = SERVICES[service][1]
    done = _run(service, port_flag, "70000")
    assert done.returncode == 2 and done.stderr.startswith("invalid configuration: "), done.stderr
    done = _run(service, "--no-such-flag")
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr
