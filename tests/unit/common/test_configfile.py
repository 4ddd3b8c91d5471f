"""The --config file and the KVBRIDGE_* environment (common/configfile.py): unknown names refused with the closest
valid one, names other kvbridge tools read accepted, YAML values turned into the environment's strings, the
environment over the file, messages naming the variable with secrets redacted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from kvbridge_services.common.config import StoreSettings
from kvbridge_services.common.configfile import (
    OTHER_ENV_NAMES,
    ConfigError,
    Origin,
    apply_config_file,
    check_environment,
    explain,
    is_secret,
    known_names,
    load_environment,
    read_config_file,
)
from kvbridge_services.gateway.config import GatewaySettings

ROOT = Path(__file__).resolve().parents[3]
KNOWN = known_names()
MODELS: list[type[BaseSettings]] = [StoreSettings, GatewaySettings]
# KVBRIDGE_* words in the repository that are not environment variables: Python constants, and the GPU runbook's
# names that docs/gpu.md says are gone.
NOT_VARIABLES = {
    "KVBRIDGE_CONNECTOR",
    "KVBRIDGE_CONNECTOR_MODULE",
    "KVBRIDGE_GPU_MODEL",
    "KVBRIDGE_GPU_PREFILL",
    "KVBRIDGE_GPU_DECODE",
    "KVBRIDGE_GPU_MEM",
}


def test_an_unknown_name_is_refused_with_the_closest_one() -> None:
    with pytest.raises(ConfigError, match=r"KVBRIDGE_GATEWAY_HTTP_PROT \(did you mean KVBRIDGE_GATEWAY_HTTP_PORT\?\)"):
        check_environment({"KVBRIDGE_GATEWAY_HTTP_PROT": "1", "PATH": "/bin"}, KNOWN)
    with pytest.raises(ConfigError, match="unknown settings in the environment: KVBRIDGE_A, KVBRIDGE_B"):
        check_environment({"KVBRIDGE_B": "1", "KVBRIDGE_A": "1"}, KNOWN)


def test_service_names_and_names_other_tools_read_are_accepted() -> None:
    check_environment(dict.fromkeys([*KNOWN, *OTHER_ENV_NAMES], "x"), KNOWN)
    assert "KVBRIDGE_TELEMETRY_HASH_KEY_HEX" in KNOWN and "KVBRIDGE_HASH_SECRET" in KNOWN


def test_every_kvbridge_name_the_repository_uses_is_accepted() -> None:
    """A variable read by a script, the deploy files, the SDK docs or a service: a new one either becomes a
    setting or joins OTHER_ENV_NAMES, or every service would refuse an environment that sets it."""
    found: dict[str, str] = {}
    for folder in ("services", "api", "connector", "scripts", "deploy", "docs", "bench", "clients"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".md", ".sh", ".yaml", ".yml", ".js", ".mjs", ".json", ""}:
                continue
            if not path.is_file() or "node_modules" in path.parts or "results" in path.parts:
                continue
            for name in re.findall(r"\bKVBRIDGE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    for name in ("README.md", "CONTRIBUTING.md"):
        for var in re.findall(r"\bKVBRIDGE_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / name).read_text()):
            found.setdefault(var, name)
    unknown = {n: where for n, where in found.items() if n not in KNOWN | OTHER_ENV_NAMES.keys() | NOT_VARIABLES}
    assert not unknown, f"add these to OTHER_ENV_NAMES (common/configfile.py) or make them settings: {unknown}"


def test_yaml_values_become_the_environments_strings(tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text(
        "KVBRIDGE_ETCD_ENDPOINTS: [a:2379, b:2379]\n"
        "KVBRIDGE_GATEWAY_PREFILL_ENGINES: [{url: 'http://p:8000', model: m}]\n"
        "KVBRIDGE_INSECURE: true\n"
        "KVBRIDGE_GATEWAY_HTTP_PORT: 8081\n"
        "kvbridge_log_level: DEBUG\n"
    )
    values = read_config_file(config, KNOWN, MODELS)
    assert values == {
        "KVBRIDGE_ETCD_ENDPOINTS": "a:2379,b:2379",
        "KVBRIDGE_GATEWAY_PREFILL_ENGINES": '[{"url": "http://p:8000", "model": "m"}]',
        "KVBRIDGE_INSECURE": "true",
        "KVBRIDGE_GATEWAY_HTTP_PORT": "8081",
        "KVBRIDGE_LOG_LEVEL": "DEBUG",
    }
    env = {"KVBRIDGE_GATEWAY_HTTP_PORT": "9000"}
    taken = apply_config_file(values, env)
    assert env["KVBRIDGE_GATEWAY_HTTP_PORT"] == "9000" and "KVBRIDGE_GATEWAY_HTTP_PORT" not in taken
    assert env["KVBRIDGE_ETCD_ENDPOINTS"] == "a:2379,b:2379"


def test_the_file_reaches_the_settings_models(tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text("KVBRIDGE_ETCD_ENDPOINTS: [a:2379, b:2379]\nKVBRIDGE_GATEWAY_HTTP_PORT: 8081\n")
    env: dict[str, str] = {"KVBRIDGE_GATEWAY_GRPC_PORT": "7000"}
    load_environment(config, MODELS, env)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        assert StoreSettings().etcd_endpoints == ["a:2379", "b:2379"]
        gateway = GatewaySettings()
        assert (gateway.http_port, gateway.grpc_port) == (8081, 7000)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("KVBRIDGE_LEASE_DEFALT_TTL_S: 3\n", "did you mean KVBRIDGE_LEASE_DEFAULT_TTL_S?"),
        ("KVBRIDGE_ENGINE_MODEL: /m\n", "read from the environment by kvbridge up --engines"),
        ("KVBRIDGE_LEASE_PORT:\n", "KVBRIDGE_LEASE_PORT has no value"),
        ("just text\n", "must be a YAML mapping"),
        ("KVBRIDGE_LEASE_PORT: [1\n", "not valid YAML at line 2"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as raised:
        read_config_file(config, KNOWN, MODELS)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_messages_name_the_variable_and_never_show_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", "not-hex-secret-value")
    monkeypatch.setenv("KVBRIDGE_GATEWAY_HTTP_PORT", "99999")
    with pytest.raises(ValidationError) as raised:
        GatewaySettings()
    line = explain(raised.value, MODELS, Origin({"KVBRIDGE_GATEWAY_HTTP_PORT": "99999"}, Path("k.yaml")))
    assert "KVBRIDGE_GATEWAY_HTTP_PORT='99999' (from k.yaml)" in line
    assert "not-hex-secret-value" not in line
    assert is_secret("KVBRIDGE_API_KEY") and is_secret("KVBRIDGE_HASH_SECRET")
    assert not is_secret("KVBRIDGE_API_KEYS_FILE")
