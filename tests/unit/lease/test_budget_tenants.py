"""A per-engine budget: one tenant's grant makes room only among its own leases, never another tenant's."""

from __future__ import annotations

import pytest

from kvbridge.errors import Reason, ResourceExhausted
from kvbridge_services.lease.table import ENTRY, LeaseTable, TableLimits


def _grant(table: LeaseTable, tenant: str, conv: str, tokens: int) -> tuple[int, list[int]]:
    record, ended = table.grant(
        kind=ENTRY,
        tenant=tenant,
        engine_id="d0",
        model="m",
        conversation_key=conv,
        retained_tokens=tokens,
        ttl_s=60,
        max_lifetime_s=600,
    )
    return record.lease_id, [e.record.lease_id for e in ended]


def test_engine_budget_never_evicts_another_tenants_lease() -> None:
    table = LeaseTable(TableLimits(engine_budget_tokens=100))
    victim, _ = _grant(table, "globex", "g1", 80)
    with pytest.raises(ResourceExhausted) as info:
        _grant(table, "acme", "a1", 40)
    assert info.value.reason == Reason.BUDGET_EXCEEDED.value
    assert victim in table.leases and table.engine_tokens["d0"] == 80


def test_engine_budget_evicts_the_granting_tenants_own_oldest_lease() -> None:
    table = LeaseTable(TableLimits(engine_budget_tokens=100))
    other, _ = _grant(table, "globex", "g1", 30)
    own_old, _ = _grant(table, "acme", "a1", 40)
    own_new, _ = _grant(table, "acme", "a2", 20)
    _grant(table, "acme", "a3", 40)
    assert own_old not in table.leases  # the granting tenant's oldest-idle lease made room
    assert other in table.leases and own_new in table.leases
    assert table.engine_tokens["d0"] == 90
