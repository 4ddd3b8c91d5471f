"""Group commit of registrations (docs/adr/0005) on real etcd: batching keeps every CAS and idempotency rule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from kvbridge.errors import KvbridgeError, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.auth import DEV_PRINCIPAL
from kvbridge_services.common.store.base import Op, Put, TxnResult

from .conftest import MODEL, Env, start_env, stop_env

pytestmark = [pytest.mark.etcd]
TOKENS = list(range(500, 500 + 40))
WIDE_WINDOW = {"register_batch_window_ms": 50.0}  # wide enough that concurrent calls share a window


async def etcd_env(etcd_server: Any, store: Any = None, **settings: Any) -> Env:
    from .conftest import etcd_store

    return await start_env(store or etcd_store([etcd_server.endpoint]), **settings)


@pytest.fixture
async def env(etcd_server: Any) -> AsyncIterator[Env]:
    e = await etcd_env(etcd_server, **WIDE_WINDOW)
    try:
        yield e
    finally:
        await stop_env(e)
        await e.store.close()


def batcher(env: Env) -> Any:
    assert env.app.registry.batcher is not None, "etcd must select group commit"
    return env.app.registry.batcher


async def register_in_process(env: Env, requests: Sequence[registry_pb2.RegisterEntryRequest]) -> list[Any]:
    """Call the registry core in order (tasks start in creation order), so one window sees them in that order."""
    return await asyncio.gather(
        *(env.app.registry.registrar.register_entry(DEV_PRINCIPAL, r) for r in requests), return_exceptions=True
    )


async def test_500_concurrent_registrations_all_acknowledged_and_stored(env: Env) -> None:
    await env.engine()
    convs = [f"conv-{i:03d}" for i in range(500)]
    leases = await asyncio.gather(*(env.lease(conv=c) for c in convs))
    requests = [env.entry_request(TOKENS, conv=c, lease_id=lease) for c, lease in zip(convs, leases, strict=True)]
    responses = await asyncio.gather(*(env.stub.RegisterEntry(r) for r in requests))
    assert [r.entry.key.conversation_key for r in responses] == convs
    assert not any(r.replayed for r in responses)
    stored, _rev = await env.store.range_prefix(env.keys.entries_prefix("acme", MODEL))
    assert len(stored) == 500
    assert {registry_pb2.Entry.FromString(kv.value).key.conversation_key for kv in stored} == set(convs)
    # Fewer write txns than registrations: they really were grouped.
    assert batcher(env).combined_commits >= 1
    assert batcher(env).combined_commits < 500


async def test_same_key_epochs_in_one_window_end_at_the_max(env: Env) -> None:
    await env.engine()
    lease = await env.lease(conv="c1")
    requests = [env.entry_request(TOKENS, conv="c1", lease_id=lease, epoch=e) for e in (5, 2, 7, 3, 6)]
    results = await register_in_process(env, requests)
    # Serialized in arrival order: 5 commits, 2 is stale, 7 supersedes 5, 3 and 6 are stale.
    ok = [r for r in results if isinstance(r, registry_pb2.RegisterEntryResponse)]
    assert [(r.entry.epoch, r.superseded_epoch) for r in ok] == [(5, 0), (7, 5)]
    stale = [r for r in results if isinstance(r, KvbridgeError)]
    assert [e.reason for e in stale] == [Reason.STALE_EPOCH] * 3
    kv = await env.store.get(env.keys.entry("acme", MODEL, "c1"))
    assert kv is not None and registry_pb2.Entry.FromString(kv.value).epoch == 7
    lookup = await env.lookup(TOKENS, conv="c1")
    assert lookup.location.epoch == 7


async def test_replayed_request_id_in_one_batch_is_idempotent(env: Env) -> None:
    await env.engine()
    lease = await env.lease(conv="c1")
    first = env.entry_request(TOKENS, conv="c1", lease_id=lease, request_id="rq-same")
    other_lease = await env.lease(conv="c2")
    conflicting = env.entry_request(TOKENS, conv="c2", lease_id=other_lease, request_id="rq-same")
    results = await register_in_process(env, [first, first, first, conflicting])
    a, b, c, d = results
    assert isinstance(a, registry_pb2.RegisterEntryResponse) and not a.replayed
    for replay in (b, c):
        assert isinstance(replay, registry_pb2.RegisterEntryResponse) and replay.replayed
        assert replay.entry == a.entry
    assert isinstance(d, KvbridgeError) and d.reason == Reason.IDEMPOTENCY_CONFLICT
    assert await env.store.get(env.keys.entry("acme", MODEL, "c2")) is None


async def test_failed_precondition_in_a_batch_does_not_fail_the_others(env: Env) -> None:
    await env.engine()
    leases = {c: await env.lease(conv=c) for c in ("a", "b", "c", "d", "e")}
    await env.register(TOKENS, conv="c", lease_id=leases["c"], epoch=9)
    await env.store.revoke_lease(leases["d"])
    requests = [env.entry_request(TOKENS, conv=c, lease_id=leases[c], epoch=2) for c in "abcde"]
    results = await register_in_process(env, requests)
    assert isinstance(results[2], KvbridgeError) and results[2].reason == Reason.STALE_EPOCH
    assert isinstance(results[3], KvbridgeError) and results[3].reason == Reason.LEASE_NOT_FOUND
    for i in (0, 1, 4):
        assert isinstance(results[i], registry_pb2.RegisterEntryResponse), results[i]
        kv = await env.store.get(env.keys.entry("acme", MODEL, "abcde"[i]))
        assert kv is not None and registry_pb2.Entry.FromString(kv.value).epoch == 2


def interfering_store(endpoint: str) -> Any:
    """Real etcd; just before the first multi-registration write txn it lets a rival win one CAS."""
    from kvbridge_services.common.store.etcd import EtcdStore

    class Interfering(EtcdStore):
        rival: tuple[bytes, bytes] | None = None

        async def txn(
            self, compares: Any, success: Sequence[Op], failure: Sequence[Op] = (), *, timeout: float = 5.0
        ) -> TxnResult:
            puts = [op for op in success if isinstance(op, Put)]
            if self.rival is not None and len(puts) > 2:
                key, value = self.rival
                self.rival = None
                await self.put(key, value)  # another replica's newer epoch lands between read and write
            return await super().txn(compares, success, failure, timeout=timeout)

    return Interfering([endpoint])


async def test_combined_write_conflict_falls_back_to_one_by_one(etcd_server: Any) -> None:
    store = interfering_store(etcd_server.endpoint)
    env = await etcd_env(etcd_server, store, **WIDE_WINDOW)
    try:
        engine = await env.engine()
        leases = {c: await env.lease(conv=c) for c in "abcd"}
        requests = [env.entry_request(TOKENS, conv=c, lease_id=leases[c], epoch=1) for c in "abcd"]
        rival = registry_pb2.Entry()
        rival.CopyFrom(requests[1].entry)
        rival.epoch = 4
        rival.engine_incarnation = engine.node_lease_id  # as the rival replica stores it
        store.rival = (env.keys.entry("acme", MODEL, "b"), rival.SerializeToString())
        results = await register_in_process(env, requests)
        assert batcher(env).fallbacks == 1
        assert isinstance(results[1], KvbridgeError) and results[1].reason == Reason.STALE_EPOCH
        for i in (0, 2, 3):
            assert isinstance(results[i], registry_pb2.RegisterEntryResponse), results[i]
            assert results[i].entry.epoch == 1
            assert await env.store.get(env.keys.entry("acme", MODEL, "abcd"[i])) is not None
    finally:
        await stop_env(env)
        await store.close()


async def test_grpc_error_for_a_stale_registration_in_a_batch(env: Env) -> None:
    """Through gRPC, the batch's per-request errors keep their status code and reason."""
    await env.engine()
    lease = await env.lease(conv="c1")
    await env.register(TOKENS, conv="c1", lease_id=lease, epoch=3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.stub.RegisterEntry(env.entry_request(TOKENS, conv="c1", lease_id=lease, epoch=2))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
