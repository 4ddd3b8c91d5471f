"""A grant's outcome through faults, on real etcd over real gRPC.

An acknowledged grant is in the table and in the store; an unacknowledged one (its client's deadline passed
while the etcd write was in flight, or leadership was lost meanwhile) is in neither once a second lease
manager has taken over. And a leadership change answers UNAVAILABLE / NOT_LEADER, never INTERNAL.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.lease.app import LeaseApp
from tests.fixtures.etcd import EtcdServer

from .harness import lease_app, wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
KEYS = KeyLayout()
ENTRY = lease_pb2.LEASE_KIND_ENTRY


@dataclass
class Grants:
    """What the clients saw: acknowledged lease ids, and every failure as code/reason."""

    acked: set[int] = field(default_factory=set)
    failures: Counter[str] = field(default_factory=Counter)
    leaders_named: set[str] = field(default_factory=set)


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[EtcdStore]:
    s = EtcdStore([etcd_server.endpoint])
    try:
        yield s
    finally:
        await s.close()


async def _granter(
    stub: lease_pb2_grpc.LeaseServiceAsyncStub, w: int, deadline_s: float, out: Grants, stop: asyncio.Event
) -> None:
    i = 0
    while not stop.is_set():
        conv, i = f"w{w}-{i}", i + 1
        request = lease_pb2.GrantLeaseRequest(
            kind=ENTRY,
            tenant="acme",
            engine_id="d0",
            model="m",
            conversation_key=conv,
            ttl=duration_pb2.Duration(seconds=600),
            request_id=f"g-{conv}" if i % 2 else "",
        )
        try:
            out.acked.add((await stub.GrantLease(request, timeout=deadline_s)).lease.lease_id)
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            out.failures[f"{exc.code().name}/{err.reason}"] += 1
            if err.metadata.get("leader"):
                out.leaders_named.add(err.metadata["leader"])
            await asyncio.sleep(0.02)


async def _stored_ids(store: EtcdStore) -> set[int]:
    kvs, _ = await store.range_prefix(KEYS.leases_prefix(), timeout=10)
    return {lease_pb2.Lease.FromString(kv.value).lease_id for kv in kvs}


async def _listed_ids(stub: lease_pb2_grpc.LeaseServiceAsyncStub) -> set[int]:
    ids: set[int] = set()
    token = ""
    while True:
        page = await stub.ListLeases(lease_pb2.ListLeasesRequest(page_size=1000, page_token=token), timeout=10)
        ids.update(le.lease_id for le in page.leases)
        if not (token := page.next_page_token):
            return ids


async def _after_takeover(store: EtcdStore) -> tuple[set[int], set[int]]:
    """A second lease manager's table and the store, once it has taken over."""
    async with lease_app(store) as (_, stub):
        return await _listed_ids(stub), await _stored_ids(store)


@pytest.mark.parametrize(("freeze_s", "leader_ttl_s"), [(1.5, 5), (3.5, 2)], ids=["leader-stays", "steps-down"])
async def test_grants_while_etcd_is_frozen_leave_no_orphan_after_takeover(
    etcd_server: EtcdServer, store: EtcdStore, freeze_s: float, leader_ttl_s: int
) -> None:
    """etcd SIGSTOPped under concurrent grants with 0.5 s client deadlines (longer than the freeze with the
    2 s leader TTL: the leader steps down meanwhile and campaigns again after)."""
    assert etcd_server.pid is not None
    grants, stop = Grants(), asyncio.Event()
    async with lease_app(store, leader_ttl_s=leader_ttl_s, leader_refresh_s=0.5) as (app, stub):
        tasks = [asyncio.create_task(_granter(stub, w, 0.5, grants, stop)) for w in range(8)]
        await asyncio.sleep(0.5)
        os.kill(etcd_server.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(freeze_s)
        finally:
            os.kill(etcd_server.pid, signal.SIGCONT)
        await wait_until(lambda: app.is_leader, timeout_s=30)
        acked_before = len(grants.acked)
        await wait_until(lambda: len(grants.acked) > acked_before + 20, timeout_s=30)  # granting again
        stop.set()
        await asyncio.gather(*tasks)
        taken_back = app.manager.taken_back
    listed, stored = await _after_takeover(store)
    print(
        f"\nfrozen {freeze_s}s: acknowledged {len(grants.acked)}, failed {dict(grants.failures)}, "
        f"taken back {taken_back}; after takeover: table {len(listed)}, store {len(stored)}"
    )
    assert grants.failures["DEADLINE_EXCEEDED/"] > 0  # grants were abandoned while their write was in flight
    if freeze_s < leader_ttl_s:  # writes that landed late were taken back (after a step-down the fence stops them)
        assert taken_back > 0
    assert set(grants.failures) <= {"DEADLINE_EXCEEDED/", "UNAVAILABLE/NOT_LEADER", "UNAVAILABLE/STORE_UNAVAILABLE"}
    assert stored == grants.acked  # nothing acknowledged lost, nothing unacknowledged left (no orphan)
    assert listed == grants.acked


async def test_step_downs_during_grants_answer_not_leader_never_internal(store: EtcdStore) -> None:
    """Two replicas; the leader is deposed (as by a failed fenced write) again and again under grants."""
    grants, stop = Grants(), asyncio.Event()
    async with lease_app(store) as (first, _):
        second = LeaseApp(store, first.policy, ServerSettings(shutdown_grace_s=0.5))
        await second.start()
        channels = [grpc.aio.insecure_channel(a.address) for a in (first, second)]
        try:
            stubs = [lease_pb2_grpc.LeaseServiceStub(ch) for ch in channels]
            tasks = [asyncio.create_task(_granter(stubs[w % 2], w, 5.0, grants, stop)) for w in range(8)]
            for _ in range(6):
                await wait_until(lambda: first.is_leader or second.is_leader, timeout_s=30)
                await asyncio.sleep(0.3)
                leader = first if first.is_leader else second
                leader.election.lost()
            await wait_until(lambda: first.is_leader or second.is_leader, timeout_s=30)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for ch in channels:
                await ch.close()
            await second.stop(0.2)
    listed, stored = await _after_takeover(store)
    print(
        f"\nstep-downs: acknowledged {len(grants.acked)}, failed {dict(grants.failures)}, "
        f"leaders named {sorted(grants.leaders_named)}"
    )
    assert set(grants.failures) <= {"UNAVAILABLE/NOT_LEADER"}, grants.failures
    assert grants.failures["UNAVAILABLE/NOT_LEADER"] > 0
    assert grants.leaders_named <= {first.address, second.address} and grants.leaders_named  # who leads now
    assert stored == grants.acked and listed == grants.acked


async def test_request_id_replays_return_the_same_lease_after_a_takeover(store: EtcdStore) -> None:
    request = lease_pb2.GrantLeaseRequest(
        kind=ENTRY,
        tenant="acme",
        engine_id="d0",
        model="m",
        conversation_key="c1",
        ttl=duration_pb2.Duration(seconds=60),
        request_id="rq-1",
    )
    async with lease_app(store) as (_, stub):
        first = (await stub.GrantLease(request, timeout=5)).lease
    assert first.request_id == "rq-1"
    async with lease_app(store) as (_, stub):  # a second manager, loading from the store
        again = (await stub.GrantLease(request, timeout=5)).lease
        other = lease_pb2.GrantLeaseRequest()
        other.CopyFrom(request)
        other.conversation_key = "c2"
        with pytest.raises(grpc.aio.AioRpcError) as conflict:
            await stub.GrantLease(other, timeout=5)
        listed = await _listed_ids(stub)
    assert again.lease_id == first.lease_id and listed == {first.lease_id}
    assert conflict.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert from_rpc_error(conflict.value).reason == "IDEMPOTENCY_CONFLICT"
