"""One deployment secret: one encoding (hex), required with API keys, and a canary the gateway checks against
each engine's registration before any reuse (kvbridge_services.gateway.trust, kvbridge.secret)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvbridge import secret as kvsecret
from kvbridge.types.v1 import types_pb2
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_services.common.auth import Authenticator, Principal, Role
from kvbridge_services.gateway import reuse
from kvbridge_services.gateway.app import deployment_secret
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.gateway.metrics import GatewayMetrics
from kvbridge_services.gateway.trust import SecretCanary, secret_mismatch

SECRET_HEX = "00112233445566778899aabbccddeeff"
SECRET = bytes.fromhex(SECRET_HEX)


def test_the_secret_is_hex_everywhere_and_anything_else_is_refused_naming_the_setting() -> None:
    assert kvsecret.parse(SECRET_HEX) == SECRET
    assert ConnectorSettings.from_extra_config({"kvbridge_hash_secret": SECRET_HEX}, env={}).hash_secret == SECRET
    assert ConnectorSettings.from_extra_config({}, env={"KVBRIDGE_HASH_SECRET": SECRET_HEX}).hash_secret == SECRET
    assert GatewaySettings(hash_secret_hex=SECRET_HEX).hash_secret_hex == SECRET_HEX
    # The same text the connector used to take as raw bytes: now refused everywhere, never reinterpreted.
    for bad in ("e2e-hash-secret-0123456789abcdef", "00" * 15, "00" * 65, "0" * 33):
        with pytest.raises(ValueError, match="KVBRIDGE_HASH_SECRET"):
            kvsecret.parse(bad)
        with pytest.raises(ValueError, match="kvbridge_hash_secret"):
            ConnectorSettings.from_extra_config({"kvbridge_hash_secret": bad}, env={})
        with pytest.raises(ValueError, match="KVBRIDGE_HASH_SECRET"):
            GatewaySettings(hash_secret_hex=bad)


def test_gateway_reads_the_connectors_setting_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", SECRET_HEX)
    assert GatewaySettings().hash_secret_hex == SECRET_HEX


def test_a_secret_is_required_with_api_keys(caplog: pytest.LogCaptureFixture) -> None:
    secure = Authenticator({"k": Principal(name="gw", tenant=None, roles=frozenset({Role.GATEWAY}))})
    with pytest.raises(ValueError, match="KVBRIDGE_HASH_SECRET is required"):
        deployment_secret(GatewaySettings(), secure)
    assert deployment_secret(GatewaySettings(hash_secret_hex=SECRET_HEX), secure) == SECRET
    with caplog.at_level(logging.WARNING):
        a = deployment_secret(GatewaySettings(), Authenticator({}))
        b = deployment_secret(GatewaySettings(), Authenticator({}))
    assert a != b and len(a) == 32 and "random secret" in caplog.text  # development mode only


def test_gateway_refuses_to_start_with_keys_and_no_secret(tmp_path: Path) -> None:
    from kvbridge_services.gateway.app import GatewayApp

    keys = tmp_path / "keys.json"
    keys.write_text('{"k": {"name": "gw", "role": "gateway"}}')
    with pytest.raises(ValueError, match="KVBRIDGE_HASH_SECRET is required"):
        GatewayApp(GatewaySettings(api_keys_file=keys, registry_address="", lease_address=""))


def _engine(caps: list[str], engine_id: str = "d0") -> types_pb2.Engine:
    return types_pb2.Engine(engine_id=engine_id, capabilities=caps)


def test_canary_check() -> None:
    ours = kvsecret.canary(SECRET)
    assert ours == kvsecret.canary(SECRET) != kvsecret.canary(bytes(16))
    assert len(ours) == 16 and ours not in SECRET_HEX
    connector = ConnectorSettings(hash_secret=SECRET).secret_capabilities()
    assert connector == [kvsecret.canary_capability(SECRET)]
    assert not secret_mismatch(["bidirectional_kv_xfer", "kvbridge_connector", *connector], ours)
    other = ConnectorSettings(hash_secret=bytes(16)).secret_capabilities()
    assert secret_mismatch(["kvbridge_connector", *other], ours)
    assert secret_mismatch(["kvbridge_connector"], ours)  # a connector that announces nothing proves nothing
    assert not secret_mismatch(["bidirectional_kv_xfer"], ours)  # stock vLLM: the gateway hashes for it


def test_a_mismatch_is_loud_and_refuses_reuse(caplog: pytest.LogCaptureFixture) -> None:
    metrics = GatewayMetrics()
    check = SecretCanary(SECRET, metrics.secret_mismatch)
    bad = _engine(["kvbridge_connector", kvsecret.canary_capability(bytes(16))])
    good = _engine(["kvbridge_connector", kvsecret.canary_capability(SECRET)], "d1")
    with caplog.at_level(logging.ERROR):
        assert check.check(bad) and not check.check(good) and not check.check(None)
        assert check.mismatch(bad) and check.mismatch(bad) and not check.mismatch(good)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "d0" in errors[0].getMessage()  # once per engine, not per turn
    assert metrics.secret_mismatch.labels("d0")._value.get() == 2  # every refused turn counts
    features = reuse.request_features({}, lora_adapter=False, secret_mismatch=True)
    policy = reuse.Policy(threshold_tokens=16)
    assert reuse.screen(features, wants_reuse=True, prompt_tokens=None, policy=policy) is reuse.NoReuse.SECRET_MISMATCH
    assert reuse.NoReuse.SECRET_MISMATCH.label == "declined:secret_mismatch"


def test_a_connector_with_a_control_plane_needs_the_secret() -> None:
    with pytest.raises(ValueError, match="deployment secret"):
        ConnectorSettings.from_extra_config({"kvbridge_registry": "127.0.0.1:1"}, env={})
    assert ConnectorSettings.from_extra_config({}, env={}).hash_secret is None  # no control plane: stock vLLM
