"""Policy validation and the watch fan-out's coalescing and overflow rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvbridge.lease.v1 import lease_pb2
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.lease.table import ENTRY, LeaseRecord
from kvbridge_services.lease.watchers import ACTIVE, ENDED, RENEWED, WatchHub


def record(lease_id: int, engine: str = "e") -> LeaseRecord:
    return LeaseRecord(lease_id, ENTRY, "t", engine, "m", f"c{lease_id}", 0, 10.0, 0.0, 100.0, 10.0, 0.0)


def test_policy_rejects_inconsistent_ttls(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        LeasePolicy(min_ttl_s=10, default_ttl_s=5)
    with pytest.raises(ValidationError):
        LeasePolicy(max_ttl_s=100, max_lifetime_s=50, default_ttl_s=10)
    monkeypatch.setenv("KVBRIDGE_LEASE_DEFAULT_TTL_S", "-1")
    with pytest.raises(ValidationError):
        LeasePolicy()
    monkeypatch.setenv("KVBRIDGE_LEASE_DEFAULT_TTL_S", "30")
    assert LeasePolicy().default_ttl_s == 30 and LeasePolicy().port == 50052


async def test_renewals_coalesce_and_only_the_engines_subscribers_hear() -> None:
    hub = WatchHub(queue_capacity=100, max_subscribers=10)
    sub = hub.subscribe("e")
    other = hub.subscribe("x")
    assert sub is not None and other is not None
    r = record(1)
    hub.publish(ACTIVE, r)
    for _ in range(50):
        hub.publish(RENEWED, r)
    [event] = sub.drain(1000)
    assert event.type == ACTIVE and event.lease.lease_id == 1
    hub.publish(RENEWED, r)
    hub.publish(ENDED, r, 6)
    [event] = sub.drain(1000)
    assert event.type == lease_pb2.LeaseEvent.TYPE_ENDED and event.reason == 6
    assert other.drain(1000) == []


async def test_a_subscriber_that_falls_behind_is_marked_for_resync() -> None:
    hub = WatchHub(queue_capacity=16, max_subscribers=1)
    sub = hub.subscribe("e")
    assert sub is not None and hub.subscribe("e") is None  # subscriber cap
    for i in range(1, 20):
        hub.publish(ACTIVE, record(i))
    assert sub.overflowed and sub.pending == {}
    hub.unsubscribe(sub)
    assert hub.count == 0
