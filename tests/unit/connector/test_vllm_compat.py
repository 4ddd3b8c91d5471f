"""The connector refuses an unsupported vLLM at construction (engine start), unless the operator allows it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvbridge_connector import compat

from .real_scheduler import kv_cache_config


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.0+cu130", "0.32.0+cpu"])
def test_supported_releases_and_their_local_builds_pass(version: str) -> None:
    assert compat.check_vllm_version(version, {}, env={}) is True


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.33.1", "0.33.0.dev12+g4ba787e", "unknown", ""])
def test_other_versions_are_refused_with_the_supported_list_and_the_override(version: str) -> None:
    with pytest.raises(compat.UnsupportedVllmVersionError) as refused:
        compat.check_vllm_version(version, {}, env={})
    message = str(refused.value)
    assert f"vLLM {version} " in message and "supported: 0.32.0, 0.33.0" in message
    assert "kvbridge_allow_unsupported_vllm" in message and "python -m kvbridge_connector.vllm_surface" in message


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        ({"kvbridge_allow_unsupported_vllm": True}, {}),
        ({"kvbridge_allow_unsupported_vllm": "true"}, {}),
        ({}, {"KVBRIDGE_ALLOW_UNSUPPORTED_VLLM": "1"}),
    ],
)
def test_the_override_runs_unchecked_with_a_warning(
    extra: dict[str, Any], env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert compat.check_vllm_version("0.34.0", extra, env=env) is False
    assert "vLLM 0.34.0 is not a supported version" in caplog.text


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        ({"kvbridge_allow_unsupported_vllm": False}, {}),
        ({"kvbridge_allow_unsupported_vllm": "no"}, {}),
        ({}, {"KVBRIDGE_ALLOW_UNSUPPORTED_VLLM": "0"}),
    ],
)
def test_a_false_override_still_refuses(extra: dict[str, Any], env: dict[str, str]) -> None:
    with pytest.raises(compat.UnsupportedVllmVersionError):
        compat.check_vllm_version("0.34.0", extra, env=env)


def test_the_installed_vllm_is_supported() -> None:
    assert compat.check_vllm_version(compat.installed_vllm_version(), {}, env={}) is True


def test_the_connector_refuses_to_construct_on_an_unsupported_vllm(
    vllm_configs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge_connector import connector
    from kvbridge_connector.scheduler import KvbridgeConnectorScheduler

    monkeypatch.delenv(compat.ENV_ALLOW_UNSUPPORTED, raising=False)
    monkeypatch.setattr(connector, "installed_vllm_version", lambda: "0.34.0")
    with pytest.raises(compat.UnsupportedVllmVersionError, match=r"does not support vLLM 0\.34\.0"):
        connector.KvbridgeConnector(vllm_configs["kv_consumer"], KVConnectorRole.SCHEDULER, kv_cache_config())
    # Allowed by the operator: it constructs (and runs unchecked).
    extra = vllm_configs["kv_consumer"].kv_transfer_config.kv_connector_extra_config
    monkeypatch.setitem(extra, "kvbridge_allow_unsupported_vllm", True)
    built = connector.KvbridgeConnector(vllm_configs["kv_consumer"], KVConnectorRole.SCHEDULER, kv_cache_config())
    scheduler = built.connector_scheduler
    assert scheduler is not None
    try:
        assert isinstance(scheduler, KvbridgeConnectorScheduler)
    finally:
        scheduler.shutdown()


def test_the_connector_declines_sleep_mode() -> None:
    from kvbridge_connector.connector import KvbridgeConnector

    assert KvbridgeConnector.supports_sleep_mode(None) is False  # type: ignore[arg-type]
