"""Every failure to start is one line on stderr naming the setting or port and the fix, with a documented exit code
(docs/settings.md, "Failures to start"): 2 configuration (a bad value, an unknown KVBRIDGE_* name, a bad --config
file), 3 a port that cannot be bound (busy, or an address that is not this machine's), 4 etcd not answering. Each
kind, for each of the three services and for `kvbridge up`, as real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.common import free_port

SERVICES = ("lease", "registry", "gateway")
COMMANDS = (*SERVICES, "up")
# The setting that names each command's (first) listening port, and the flag that overrides it.
PORT_SETTING = {
    "lease": ("KVBRIDGE_LEASE_PORT", "--port"),
    "registry": ("KVBRIDGE_REGISTRY_PORT", "--port"),
    "gateway": ("KVBRIDGE_GATEWAY_HTTP_PORT", "--http-port"),
    "up": ("KVBRIDGE_REGISTRY_PORT", "--registry-port"),
}
HOST_SETTING = {"gateway": "KVBRIDGE_GATEWAY_HOST"}
# A documentation address (TEST-NET-1, RFC 5737): never one of this machine's.
NOT_LOCAL = "192.0.2.1"


def _argv(command: str) -> list[str]:
    if command == "up":
        return [sys.executable, "-m", "kvbridge_services.cli", "up", "--no-gateway"]
    return [sys.executable, "-m", f"kvbridge_services.{command}"]


def _free_ports_env(command: str) -> dict[str, str]:
    """Every port of the command free (0 where a setting allows it), so only the fault under test can fail."""
    return {
        "KVBRIDGE_LEASE_PORT": "0",
        "KVBRIDGE_REGISTRY_PORT": "0",
        "KVBRIDGE_LEASE_METRICS_PORT": "0",
        "KVBRIDGE_REGISTRY_METRICS_PORT": "0",
        "KVBRIDGE_GATEWAY_HTTP_PORT": "0",
        "KVBRIDGE_GATEWAY_GRPC_PORT": "0",
        "KVBRIDGE_GATEWAY_REGISTRY_ADDRESS": "",
    }


def _start(command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "OTEL_"))}
    return subprocess.run(
        [*_argv(command), *args],
        env={**clean, **_free_ports_env(command), **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
    )


def _one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield port


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_value_names_the_variable_and_exits_2(command: str) -> None:
    setting = PORT_SETTING[command][0]
    line = _one_line(_start(command, env={setting: "not-a-port"}), 2)
    assert f"{setting}='not-a-port'" in line and "valid integer" in line and "docs/settings.md" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_name_is_refused_with_the_closest_valid_one(command: str) -> None:
    line = _one_line(_start(command, env={"KVBRIDGE_LEASE_DEFALT_TTL_S": "30"}), 2)
    assert "unknown setting" in line and "KVBRIDGE_LEASE_DEFALT_TTL_S" in line
    assert "did you mean KVBRIDGE_LEASE_DEFAULT_TTL_S?" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_names_read_by_other_tools_are_not_refused(command: str) -> None:
    # Read by the dev-engine launcher, scripts/test and the SDK examples, not by the services: accepted. A bad
    # value of the service's own port proves the environment was checked and passed.
    others = {"KVBRIDGE_ENGINE_MODEL": "/m", "KVBRIDGE_TEST_WORKERS": "2", "KVBRIDGE_MODEL": "m"}
    setting = PORT_SETTING[command][0]
    line = _one_line(_start(command, env={**others, setting: "-5"}), 2)
    assert setting in line and "unknown" not in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_busy_port_is_named_with_its_setting_and_flag_and_exits_3(command: str, busy_port: int) -> None:
    setting, flag = PORT_SETTING[command]
    line = _one_line(_start(command, env={setting: str(busy_port)}), 3)
    assert f"port {busy_port} ({setting} or {flag}) is in use" in line and "choose another port" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_an_address_not_of_this_machine_is_named_and_exits_3(command: str) -> None:
    host_setting = HOST_SETTING.get(command, "KVBRIDGE_HOST")
    done = _start(command, env={host_setting: NOT_LOCAL, "KVBRIDGE_INSECURE": "1"})
    line = _one_line(done, 3)
    assert f"{NOT_LOCAL} ({host_setting}) is not an address of this machine" in line and "127.0.0.1" in line


@pytest.mark.parametrize("command", ("lease", "registry", "up"))  # the gateway keeps no store
def test_unreachable_etcd_is_named_and_exits_4(command: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    env = {"KVBRIDGE_ETCD_ENDPOINTS": endpoint, "KVBRIDGE_ETCD_START_TIMEOUT_S": "1"}
    line = _one_line(_start(command, env=env), 4)
    assert f"etcd at {endpoint} (KVBRIDGE_ETCD_ENDPOINTS) did not answer within 1 s" in line
    assert "start etcd or fix KVBRIDGE_ETCD_ENDPOINTS" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_the_config_file_is_read_and_the_environment_overrides_it(command: str, tmp_path: Path) -> None:
    setting = PORT_SETTING[command][0]
    config = tmp_path / "kvbridge.yaml"
    config.write_text(f"{setting}: 70000\nKVBRIDGE_LOG_LEVEL: INFO\n")
    line = _one_line(_start(command, "--config", str(config), env={setting: ""}), 2)
    assert setting in line  # the environment's empty value overrides the file's: still refused, as ''
    env = {k: v for k, v in _free_ports_env(command).items() if k != setting}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "OTEL_"))}
    done = subprocess.run(
        [*_argv(command), "--config", str(config)], env={**clean, **env}, capture_output=True, text=True, timeout=90
    )
    line = _one_line(done, 2)
    assert f"{setting}='70000' (from {config})" in line and ("65535" in line or "65536" in line)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_name_in_the_config_file_is_refused(command: str, tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text("KVBRIDGE_GATEWAY_HTTP_PROT: 8080\n")
    line = _one_line(_start(command, "--config", str(config)), 2)
    assert f"--config {config}: unknown setting KVBRIDGE_GATEWAY_HTTP_PROT" in line
    assert "did you mean KVBRIDGE_GATEWAY_HTTP_PORT?" in line


@pytest.mark.parametrize("text", ["KVBRIDGE_LEASE_PORT: [1\n", "- a\n- b\n"])
def test_a_malformed_config_file_is_one_line(text: str, tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text(text)
    line = _one_line(_start("lease", "--config", str(config)), 2)
    assert f"--config {config}: " in line
    line = _one_line(_start("lease", "--config", str(tmp_path / "missing.yaml")), 2)
    assert "cannot read it" in line
