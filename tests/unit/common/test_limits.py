"""Per-principal RPC limits (common/limits.py) and the settings that size them (ADR 0025)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvbridge.errors import Reason, ResourceExhausted
from kvbridge_services.common.auth import DEV_PRINCIPAL, Principal, Role
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.limits import RpcLimiter, RpcLimits

ACME = Principal("acme-app", "acme")
ACME_OTHER_KEY = Principal("acme-batch", "acme")
GLOBEX = Principal("globex-app", "globex")
ENGINE = Principal("connector", None, frozenset({Role.ENGINE}))


def _refused(limiter: RpcLimiter, principal: Principal | None) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as info:
        limiter.admit(principal)
    assert info.value.reason == Reason.OVERLOADED.value
    return info.value


def test_one_tenant_is_capped_across_its_keys_and_others_still_get_in() -> None:
    limiter = RpcLimiter(RpcLimits(total=10, tenant_pool=5, per_tenant=3, public=2))
    slots = [limiter.admit(ACME), limiter.admit(ACME_OTHER_KEY), limiter.admit(ACME)]
    err = _refused(limiter, ACME_OTHER_KEY)
    assert err.metadata == {"limit": "per_tenant", "max": "3"}
    assert limiter.admit(GLOBEX) is not None
    slots[0].release()
    slots[0].release()  # idempotent
    assert limiter.by_tenant["acme"] == 2
    limiter.admit(ACME)


def test_tenants_together_never_take_the_services_share() -> None:
    limits = RpcLimits(total=10, tenant_pool=4, per_tenant=4, public=2)
    limiter = RpcLimiter(limits)
    for _ in range(4):
        limiter.admit(ACME)
    assert _refused(limiter, GLOBEX).metadata["limit"] == "tenant_pool"
    limiter.admit(None)
    limiter.admit(None)
    assert _refused(limiter, None).metadata["limit"] == "public"
    # Tenants and public callers at their caps: the reserve is whole.
    assert limits.service_reserve == 4
    for _ in range(4):
        limiter.admit(ENGINE if _ % 2 else DEV_PRINCIPAL)
    assert _refused(limiter, ENGINE).metadata == {"limit": "total", "max": "10"}


def test_released_slots_come_back_and_metrics_count_refusals() -> None:
    registry = CollectorRegistry()
    limiter = RpcLimiter(RpcLimits(total=4, tenant_pool=1, per_tenant=1, public=1), registry)
    slot = limiter.admit(ACME)
    _refused(limiter, GLOBEX)
    assert registry.get_sample_value("kvbridge_grpc_server_limited_total", {"limit": "tenant_pool"}) == 1
    assert registry.get_sample_value("kvbridge_grpc_server_admitted", {"class": "tenant"}) == 1
    slot.release()
    assert limiter.by_tenant == {} and limiter.in_use == 0
    assert registry.get_sample_value("kvbridge_grpc_server_admitted", {"class": "tenant"}) == 0
    # A second limiter on the same registry (two servers of one service in a test) works without figures.
    RpcLimiter(RpcLimits(total=4, tenant_pool=1, per_tenant=1, public=1), registry).admit(GLOBEX)


def test_settings_size_the_limits_and_keep_a_service_share() -> None:
    limits = ServerSettings().rpc_limits()
    assert (limits.total, limits.tenant_pool, limits.per_tenant, limits.public) == (1024, 512, 128, 32)
    assert limits.service_reserve == 480
    small = ServerSettings(max_concurrent_rpcs=8, max_rpcs_per_tenant=100).rpc_limits()
    assert (small.tenant_pool, small.per_tenant, small.public) == (4, 4, 2)
    with pytest.raises(ValueError, match="tenant_rpc_share"):
        ServerSettings(max_concurrent_rpcs=4, tenant_rpc_share=0.9)


def test_grpc_connection_options() -> None:
    opts = dict(ServerSettings().grpc_options())
    assert opts["grpc.max_connection_idle_ms"] == 900_000
    assert opts["grpc.max_connection_age_ms"] == 7_200_000
    assert opts["grpc.max_connection_age_grace_ms"] == 60_000
    assert opts["grpc.keepalive_time_ms"] == 60_000
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] == 5_000
    off = dict(ServerSettings(max_connection_idle_s=0, max_connection_age_s=0).grpc_options())
    assert "grpc.max_connection_idle_ms" not in off and "grpc.max_connection_age_ms" not in off
