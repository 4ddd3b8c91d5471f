"""The in-memory lease table, on a fake clock."""

from __future__ import annotations

import pytest

from kvbridge.errors import ResourceExhausted
from kvbridge.types.v1 import types_pb2
from kvbridge_services.lease.table import ENTRY, NODE, LeaseTable, TableLimits

R = types_pb2.RevokeReason


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def entry(table: LeaseTable, conv: str, *, tenant: str = "t", engine: str = "e", tokens: int = 0, ttl: float = 10.0):
    return table.grant(
        kind=ENTRY,
        tenant=tenant,
        engine_id=engine,
        model="m",
        conversation_key=conv,
        retained_tokens=tokens,
        ttl_s=ttl,
        max_lifetime_s=1000.0,
    )


def test_renewal_keeps_a_lease_alive_across_many_ttls() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    record, _ = entry(table, "c1", ttl=1.0)
    for _ in range(50):
        clock.now += 0.5
        assert table.renew(record.lease_id) is record
        assert table.pop_expired() == []
    assert record.lease_id in table.leases


def test_unrenewed_lease_expires_at_its_deadline() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    record, _ = entry(table, "c1", ttl=2.0)
    clock.now += 1.99
    assert table.pop_expired() == []
    clock.now += 0.02
    [ended] = table.pop_expired()
    assert ended.record is record and ended.reason == R.REVOKE_REASON_EXPIRED
    assert table.renew(record.lease_id) is None
    assert table.ended_reason(record.lease_id) == R.REVOKE_REASON_EXPIRED


def test_max_lifetime_caps_renewals() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    record, _ = table.grant(
        kind=ENTRY, tenant="t", engine_id="e", model="m", conversation_key="c", ttl_s=5.0, max_lifetime_s=8.0
    )
    clock.now += 4
    table.renew(record.lease_id)
    assert record.deadline == record.max_deadline
    clock.now += 4.01
    [ended] = table.pop_expired()
    assert ended.reason == R.REVOKE_REASON_MAX_LIFETIME


def test_node_lease_loss_ends_the_engines_entry_leases() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    node, _ = table.grant(kind=NODE, tenant="", engine_id="e", ttl_s=1.0, max_lifetime_s=100.0)
    a, _ = entry(table, "a", ttl=50)
    b, _ = entry(table, "b", ttl=50)
    other, _ = entry(table, "x", engine="other", ttl=50)
    clock.now += 1.5
    ended = table.pop_expired()
    assert {(e.record.lease_id, e.reason) for e in ended} == {
        (node.lease_id, R.REVOKE_REASON_EXPIRED),
        (a.lease_id, R.REVOKE_REASON_ENGINE_GONE),
        (b.lease_id, R.REVOKE_REASON_ENGINE_GONE),
    }
    assert other.lease_id in table.leases


def test_budget_evicts_oldest_idle_first() -> None:
    clock = FakeClock()
    table = LeaseTable(TableLimits(tenant_budget_tokens=300), clock=clock)
    first, _ = entry(table, "1", tokens=100)
    clock.now += 1
    second, _ = entry(table, "2", tokens=100)
    clock.now += 1
    third, _ = entry(table, "3", tokens=100)
    clock.now += 1
    table.renew(first.lease_id)  # now "second" is the oldest idle
    _fourth, evicted = entry(table, "4", tokens=150)
    assert [e.record.lease_id for e in evicted] == [second.lease_id, third.lease_id]
    assert all(e.reason == R.REVOKE_REASON_BUDGET for e in evicted)
    assert table.tenant_tokens["t"] == 250
    with pytest.raises(ResourceExhausted):
        entry(table, "5", tokens=301)


def test_table_cap() -> None:
    table = LeaseTable(TableLimits(max_leases=2), clock=FakeClock())
    entry(table, "a")
    entry(table, "b")
    with pytest.raises(ResourceExhausted):
        entry(table, "c")


def test_ids_are_unique_and_ascending() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    ids = [entry(table, str(i))[0].lease_id for i in range(100)]
    assert ids == sorted(set(ids)) and all(ids)
    restarted = LeaseTable(clock=clock)
    for lease_id in ids:
        restarted.restore(table.leases[lease_id])
    assert entry(restarted, "new")[0].lease_id > ids[-1]


def test_dirty_tracking_and_conversation_index() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    old, _ = entry(table, "c")
    new, _ = entry(table, "c")
    assert table.conversation_lease(("t", "m", "c")) == new.lease_id
    clock.now += 1
    table.renew(old.lease_id)
    assert table.take_dirty() == [old]
    assert table.take_dirty() == []
    table.end(new.lease_id, R.REVOKE_REASON_SUPERSEDED)
    assert table.conversation_lease(("t", "m", "c")) is None


def test_checkpoints_only_leases_that_lag_and_at_most_limit() -> None:
    clock = FakeClock()
    table = LeaseTable(TableLimits(checkpoint_lag_s=5.0), clock=clock)
    records = [entry(table, str(i), ttl=100)[0] for i in range(10)]
    clock.now += 1
    for r in records:
        table.renew(r.lease_id)
    assert table.take_dirty() == []  # 1 s ahead of the stored deadline: within the lag
    clock.now += 5
    for r in records:
        table.renew(r.lease_id)
    assert len(table.take_dirty(limit=4)) == 4
    assert len(table.take_dirty()) == 6
