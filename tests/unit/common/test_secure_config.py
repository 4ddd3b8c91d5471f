"""Secure configuration: one name per setting across the services (one keys file, one service key), and
secure by default (no keys: loopback only, unless KVBRIDGE_INSECURE=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_services.common.auth import Authenticator, Principal, Role
from kvbridge_services.common.config import ServerSettings, check_bind, is_loopback
from kvbridge_services.common.server import GrpcServer
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.registry.config import RegistrySettings

STACK_ENV = (
    "KVBRIDGE_API_KEY",
    "KVBRIDGE_API_KEYS_FILE",
    "KVBRIDGE_GATEWAY_CONTROL_API_KEY",
    "KVBRIDGE_GATEWAY_API_KEYS_FILE",
    "KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY",
    "KVBRIDGE_INSECURE",
    "KVBRIDGE_HOST",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STACK_ENV:
        monkeypatch.delenv(name, raising=False)


def test_one_keys_file_and_one_service_key_configure_every_service(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.json"
    monkeypatch.setenv("KVBRIDGE_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("KVBRIDGE_API_KEY", "svc")
    assert ServerSettings().api_keys_file == keys  # registry and lease manager
    gw = GatewaySettings()
    assert (gw.api_keys_file, gw.control_api_key) == (keys, "svc")  # the README's name, not only _GATEWAY_
    assert RegistrySettings().lease_service_api_key == "svc"  # the registry calls the lease manager with it


def test_per_service_overrides_and_older_names_still_win_or_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_API_KEY", "svc")
    monkeypatch.setenv("KVBRIDGE_GATEWAY_CONTROL_API_KEY", "gw")
    monkeypatch.setenv("KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY", "reg")
    monkeypatch.setenv("KVBRIDGE_GATEWAY_API_KEYS_FILE", "/old/name.json")
    assert GatewaySettings().control_api_key == "gw"
    assert RegistrySettings().lease_service_api_key == "reg"
    assert GatewaySettings().api_keys_file == Path("/old/name.json")
    assert GatewaySettings(control_api_key="kw").control_api_key == "kw"  # constructor arguments (tests, stack)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("gateway.example", False),
        ("", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_no_keys_means_loopback_only_unless_insecure_is_explicit() -> None:
    check_bind("127.0.0.1", secured=False, insecure=False)
    check_bind("0.0.0.0", secured=True, insecure=False)
    check_bind("0.0.0.0", secured=False, insecure=True)
    with pytest.raises(ValueError, match="KVBRIDGE_INSECURE=1"):
        check_bind("0.0.0.0", secured=False, insecure=False)


async def test_a_server_without_keys_refuses_a_public_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # async: grpc.aio builds its server on the running loop (a sync test after others has none).
    with pytest.raises(ValueError, match=r"refusing to listen on '0\.0\.0\.0' without API keys"):
        GrpcServer(ServerSettings(host="0.0.0.0"), 0, [], auth=Authenticator({}))
    secured = Authenticator({"k": Principal(name="op", tenant=None, roles=frozenset({Role.OPERATOR}))})
    GrpcServer(ServerSettings(host="0.0.0.0"), 0, [], auth=secured)
    monkeypatch.setenv("KVBRIDGE_INSECURE", "1")
    assert ServerSettings().insecure
    GrpcServer(ServerSettings(host="0.0.0.0"), 0, [], auth=Authenticator({}))


def test_the_gateway_without_keys_refuses_a_public_address() -> None:
    from kvbridge_services.gateway.app import GatewayApp

    with pytest.raises(ValueError, match="without API keys"):
        GatewayApp(GatewaySettings(host="0.0.0.0", registry_address="", lease_address=""))
