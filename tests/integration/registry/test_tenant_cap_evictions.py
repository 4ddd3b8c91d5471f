"""The per-tenant entry cap evicts the oldest-idle entry as a recorded eviction: counted by reason in
``kvbridge_registry_entries_evicted_total``, logged with the entry, its lease revoked with BUDGET."""

from __future__ import annotations

import logging

import pytest

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.memory import MemoryStore

from .conftest import start_env, stop_env
from .test_registry_service import HISTORY

V = registry_pb2.LookupVerdict


async def test_a_cap_eviction_is_counted_logged_and_revoked(caplog: pytest.LogCaptureFixture) -> None:
    env = await start_env(MemoryStore(), max_entries_per_tenant=2)
    try:
        await env.engine()
        metric = "kvbridge_registry_entries_evicted_total"
        assert env.app.telemetry.registry.get_sample_value(metric, {"reason": "tenant_cap"}) is None
        leases = [(await env.register(HISTORY[:40], conv=f"c{i}")).entry.lease_id for i in range(2)]
        with caplog.at_level(logging.INFO, logger="kvbridge_services.registry.evictions"):
            await env.register(HISTORY[:40], conv="c2")
            await env.register(HISTORY[:40], conv="c3")
        assert env.app.telemetry.registry.get_sample_value(metric, {"reason": "tenant_cap"}) == 2
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted entry")]
        assert len(lines) == 2 and "/c0 " in lines[0] and "/c1 " in lines[1] and "cap of 2 entries" in lines[0]
        assert f"lease {leases[0]:x} revoked" in lines[0]
        assert (await env.lookup(HISTORY[:40], conv="c0")).verdict == V.LOOKUP_VERDICT_NOT_FOUND
        await env.app.revoker.drain()
        assert {(lease, types_pb2.REVOKE_REASON_BUDGET) for lease in leases} <= set(env.releaser.revoked)
    finally:
        await stop_env(env)
        await env.store.close()
