"""Lease manager on real etcd, over real gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.etcd import EtcdStore
from tests.fixtures.common import read_message

from .harness import lease_app

pytestmark = pytest.mark.etcd
R = types_pb2.RevokeReason
KEYS = KeyLayout()
ENTRY = lease_pb2.LEASE_KIND_ENTRY
NODE = lease_pb2.LEASE_KIND_NODE


def ttl(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def grant_entry(conv: str, *, engine: str = "eng-1", seconds: float = 2.0, tokens: int = 0, tenant: str = "acme"):
    return lease_pb2.GrantLeaseRequest(
        kind=ENTRY,
        tenant=tenant,
        engine_id=engine,
        model="m",
        conversation_key=conv,
        retained_tokens=tokens,
        ttl=ttl(seconds),
    )


@pytest.fixture
async def store(etcd_server):
    s = EtcdStore([etcd_server.endpoint])
    yield s
    await s.close()


async def put_entry(store, conv: str, lease_id: int, tenant: str = "acme") -> None:
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant=tenant, model="m", conversation_key=conv), engine_id="eng-1", lease_id=lease_id
    )
    await store.put(KEYS.entry(tenant, "m", conv), entry.SerializeToString())


@pytest.mark.serial  # a time bound (scripts/test)
async def test_renewal_keeps_alive_and_silence_expires_within_ttl_plus_1s(store) -> None:
    async with lease_app(store, checkpoint_interval_s=0.5) as (_app, stub):
        kept = (await stub.GrantLease(grant_entry("kept", seconds=1.0))).lease
        call = stub.KeepAlive()
        for _ in range(16):  # 4 s = 4 TTLs of heartbeats every TTL/4
            await call.write(lease_pb2.KeepAliveRequest(lease_ids=[kept.lease_id]))
            [status] = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
            assert status.alive
            await asyncio.sleep(0.25)
        got = (await stub.GetLease(lease_pb2.GetLeaseRequest(lease_id=kept.lease_id))).lease
        assert got.last_renew_time.seconds >= kept.grant_time.seconds + 3
        await call.done_writing()

        lonely = (await stub.GrantLease(grant_entry("lonely", seconds=1.0))).lease
        await put_entry(store, "lonely", lonely.lease_id)
        start = time.monotonic()
        while await store.get(KEYS.lease(lonely.lease_id)) is not None:
            assert time.monotonic() - start < 2.0, "unrenewed lease outlived TTL + 1 s"
            await asyncio.sleep(0.05)
        assert await store.get(KEYS.entry("acme", "m", "lonely")) is None


@pytest.mark.serial  # a time bound (scripts/test)
async def test_revoke_reaches_watcher_within_1s_and_deletes_entry(store) -> None:
    async with lease_app(store) as (_app, stub):
        lease = (await stub.GrantLease(grant_entry("c1", seconds=30))).lease
        await put_entry(store, "c1", lease.lease_id)
        watch = stub.WatchLeases(lease_pb2.WatchLeasesRequest(engine_id="eng-1"))
        first = await read_message(watch, lease_pb2.WatchLeasesResponse)
        assert first.snapshot_complete and [e.lease.lease_id for e in first.events] == [lease.lease_id]
        sent = time.monotonic()
        await stub.RevokeLease(
            lease_pb2.RevokeLeaseRequest(lease_id=lease.lease_id, reason=R.REVOKE_REASON_CLIENT_CLOSED)
        )
        while True:
            msg = await asyncio.wait_for(read_message(watch, lease_pb2.WatchLeasesResponse), 1.0)
            ended = [e for e in msg.events if e.type == lease_pb2.LeaseEvent.TYPE_ENDED]
            if ended:
                break
        assert time.monotonic() - sent < 1.0
        assert ended[0].lease.lease_id == lease.lease_id and ended[0].reason == R.REVOKE_REASON_CLIENT_CLOSED
        assert await store.get(KEYS.entry("acme", "m", "c1")) is None
        assert await store.get(KEYS.lease(lease.lease_id)) is None
        watch.cancel()


async def test_entry_of_a_newer_lease_is_not_deleted(store) -> None:
    async with lease_app(store) as (_app, stub):
        old = (await stub.GrantLease(grant_entry("c", seconds=30))).lease
        new = (await stub.GrantLease(grant_entry("c", seconds=30))).lease
        await put_entry(store, "c", new.lease_id)
        await stub.RevokeLease(lease_pb2.RevokeLeaseRequest(lease_id=old.lease_id, reason=R.REVOKE_REASON_SUPERSEDED))
        assert await store.get(KEYS.entry("acme", "m", "c")) is not None


async def test_node_lease_loss_revokes_entries_with_engine_gone(store) -> None:
    async with lease_app(store) as (_app, stub):
        node = (await stub.GrantLease(lease_pb2.GrantLeaseRequest(kind=NODE, engine_id="eng-1", ttl=ttl(1)))).lease
        engine = types_pb2.Engine(engine_id="eng-1", node_lease_id=node.lease_id)
        await store.put(KEYS.engine("eng-1"), engine.SerializeToString())
        entries = [(await stub.GrantLease(grant_entry(f"c{i}", seconds=60))).lease for i in range(3)]
        for i, e in enumerate(entries):
            await put_entry(store, f"c{i}", e.lease_id)
        watch = stub.WatchLeases(lease_pb2.WatchLeasesRequest(engine_id="eng-1"))
        snapshot = await read_message(watch, lease_pb2.WatchLeasesResponse)
        assert len(snapshot.events) == 4
        gone: dict[int, int] = {}
        async with asyncio.timeout(5):
            while len(gone) < 4:
                for event in (await read_message(watch, lease_pb2.WatchLeasesResponse)).events:
                    if event.type == lease_pb2.LeaseEvent.TYPE_ENDED:
                        gone[event.lease.lease_id] = event.reason
        assert gone[node.lease_id] == R.REVOKE_REASON_EXPIRED
        assert all(gone[e.lease_id] == R.REVOKE_REASON_ENGINE_GONE for e in entries)
        assert await store.get(KEYS.engine("eng-1")) is None
        for i in range(3):
            assert await store.get(KEYS.entry("acme", "m", f"c{i}")) is None
        watch.cancel()


async def test_budget_evicts_oldest_idle_first(store) -> None:
    async with lease_app(store, tenant_budget_tokens=1000) as (_app, stub):
        a = (await stub.GrantLease(grant_entry("a", seconds=60, tokens=400))).lease
        b = (await stub.GrantLease(grant_entry("b", seconds=60, tokens=400))).lease
        call = stub.KeepAlive()
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=[a.lease_id]))
        await call.read()
        response = await stub.GrantLease(grant_entry("c", seconds=60, tokens=400))
        assert list(response.evicted_lease_ids) == [b.lease_id]
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=[b.lease_id]))
        [status] = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert not status.alive and status.reason == R.REVOKE_REASON_BUDGET
        await call.done_writing()


async def test_restart_recovers_every_acknowledged_lease(store) -> None:
    async with lease_app(store) as (_app, stub):
        ids = [(await stub.GrantLease(grant_entry(f"c{i}", seconds=30))).lease.lease_id for i in range(50)]
    async with lease_app(store) as (app, stub):
        listed = await stub.ListLeases(lease_pb2.ListLeasesRequest(page_size=1000))
        assert sorted(lease.lease_id for lease in listed.leases) == sorted(ids)
        assert len(app.manager.table) == 50


def reason_of(exc: grpc.aio.AioRpcError) -> str:
    return from_rpc_error(exc).reason


async def test_bad_input_gets_clear_errors(store) -> None:
    async with lease_app(store, max_ids_per_keepalive=10_000, max_ttl_s=3600) as (_app, stub):
        for seconds, reason in ((0, "TTL_OUT_OF_RANGE"), (-1, "INVALID_FIELD"), (10**7, "TTL_OUT_OF_RANGE")):
            request = grant_entry("x")
            request.ttl.seconds = seconds
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GrantLease(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason_of(info.value) in (reason, "TTL_OUT_OF_RANGE")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GrantLease(grant_entry("x", engine="bad/engine"))
        assert reason_of(info.value) == "INVALID_FIELD"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetLease(lease_pb2.GetLeaseRequest(lease_id=12345))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and reason_of(info.value) == "LEASE_NOT_FOUND"
        call = stub.KeepAlive()
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=[987654321]))
        [status] = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert not status.alive
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=range(1, 100_001)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(info.value) == "TOO_LARGE"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RevokeLease(lease_pb2.RevokeLeaseRequest(lease_id=1))
        assert reason_of(info.value) == "INVALID_FIELD"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListLeases(lease_pb2.ListLeasesRequest(page_token="garbage"))
        assert reason_of(info.value) == "INVALID_PAGE_TOKEN"


async def test_grant_is_idempotent_by_request_id(store) -> None:
    async with lease_app(store) as (_app, stub):
        request = grant_entry("c")
        request.request_id = "req-1"
        first = await stub.GrantLease(request)
        again = await stub.GrantLease(request)
        assert first.lease.lease_id == again.lease.lease_id
        request.retained_tokens = 5
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GrantLease(request)
        assert reason_of(info.value) == "IDEMPOTENCY_CONFLICT"
