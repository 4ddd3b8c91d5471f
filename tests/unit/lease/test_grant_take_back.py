"""A grant whose store write outlives the step-down's wait is still taken back (ADR 0011), with a persistence
whose write never answers (as a frozen etcd)."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.errors import Unavailable
from kvbridge.lease.v1 import lease_pb2
from kvbridge_services.lease.manager import GrantSpec, LeaseManager
from kvbridge_services.lease.persistence import StoreCounters
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.lease.table import LeaseRecord


class HangingPersistence:
    """Grant writes hang (their outcome is never known); take-backs are recorded."""

    def __init__(self) -> None:
        self.counters = StoreCounters()
        self.writes_started = asyncio.Event()
        self.taken_back: list[int] = []

    async def load(self) -> list[LeaseRecord]:
        return []

    def encode(self, record: LeaseRecord) -> bytes:
        return str(record.lease_id).encode()

    async def save_granted(self, record: LeaseRecord, value: bytes) -> None:
        self.writes_started.set()
        await asyncio.Event().wait()

    async def take_back(self, record: LeaseRecord, value: bytes) -> bool:
        assert value == str(record.lease_id).encode()  # exactly the bytes the grant wrote
        self.taken_back.append(record.lease_id)
        return True


async def test_a_grant_the_step_down_stopped_waiting_for_is_taken_back_after_it() -> None:
    persistence = HangingPersistence()
    # store_timeout_s 0.01: the step-down waits 4 x 0.01 + 1 s for grants in flight, then cancels their writes.
    manager = LeaseManager(LeasePolicy(store_timeout_s=0.01, checkpoint_interval_s=0), persistence)  # type: ignore[arg-type]
    await manager.take_over()
    spec = GrantSpec(lease_pb2.LEASE_KIND_ENTRY, "acme", "d0", "m", "c1", 0, 60.0)
    grant = asyncio.create_task(manager.grant(spec))
    await persistence.writes_started.wait()
    lease_id = next(iter(manager.table.leases))
    await manager.step_down()
    with pytest.raises(Unavailable) as refused:
        await grant
    assert refused.value.reason == "NOT_LEADER"
    async with asyncio.timeout(5):
        while not persistence.taken_back:  # noqa: ASYNC110 - the take-back runs on its own after the step-down
            await asyncio.sleep(0.01)
    assert persistence.taken_back == [lease_id]
    assert manager.taken_back == 1 and len(manager.table) == 0
