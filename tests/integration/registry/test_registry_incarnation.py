"""Entries are bound to an engine incarnation (its node lease): a decode engine restarted under the same id
never has the previous process's entries answered (ARCHITECTURE invariant 6). Real gRPC, MemoryStore and etcd."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from .conftest import BLOCK, MODEL, Env, chain

V = registry_pb2.LookupVerdict
HISTORY = list(range(2000, 2000 + 80))  # 20 blocks


async def test_a_restart_under_the_same_id_ends_the_old_entries(env: Env) -> None:
    first = await env.engine("d0")
    old = await env.register(HISTORY)
    # Bound to the incarnation the registry knows, though the request did not name one.
    assert old.entry.engine_incarnation == first.node_lease_id
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT

    second = await env.engine("d0")  # a new process: new node lease; the old one is still alive
    assert second.node_lease_id != first.node_lease_id
    got = await env.lookup(HISTORY)
    # ENGINE_RESTARTED while the old entry is still indexed, NOT_FOUND once it is deleted: never a hit.
    assert got.verdict in (V.LOOKUP_VERDICT_ENGINE_RESTARTED, V.LOOKUP_VERDICT_NOT_FOUND)
    assert not got.HasField("location")
    keyless = await env.stub.LookupEntry(
        registry_pb2.LookupEntryRequest(tenant="acme", model=MODEL, block_hashes=chain(HISTORY), block_size=BLOCK)
    )
    assert keyless.verdict == V.LOOKUP_VERDICT_NOT_FOUND  # content lookups skip it too

    # The old entry is deleted and its lease revoked as ENGINE_GONE, off the RegisterEngine path.
    async with asyncio.timeout(10):
        while (old.entry.lease_id, types_pb2.REVOKE_REASON_ENGINE_GONE) not in env.releaser.revoked:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.stub.GetEntry(registry_pb2.GetEntryRequest(key=old.entry.key))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    # The new process registers the conversation again (its own epoch numbering): answered, new incarnation.
    new = await env.register(HISTORY, epoch=1)
    assert new.entry.engine_incarnation == second.node_lease_id and new.superseded_epoch == 0
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT


async def test_an_entry_of_a_previous_incarnation_is_refused(env: Env) -> None:
    first = await env.engine("d0")
    second = await env.engine("d0")
    late = env.entry_request(HISTORY, lease_id=await env.lease(conv="c1"))
    late.entry.engine_incarnation = first.node_lease_id  # retained by the process that is gone
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.stub.RegisterEntry(late)
    err = from_rpc_error(info.value)
    assert (info.value.code(), err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ENGINE_RESTARTED")
    assert err.metadata["engine_incarnation"] == str(second.node_lease_id)
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_NOT_FOUND

    current = env.entry_request(HISTORY, lease_id=await env.lease(conv="c1"))
    current.entry.engine_incarnation = second.node_lease_id
    ok = await env.stub.RegisterEntry(current)
    assert ok.entry.engine_incarnation == second.node_lease_id
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT


async def test_a_stale_epoch_of_a_previous_incarnation_does_not_block_the_new_one(env: Env) -> None:
    await env.engine("d0")
    await env.register(HISTORY, epoch=5)
    await env.engine("d0")
    # Epoch 2 < 5 would be STALE_EPOCH against a live entry; the stored one belongs to a dead process.
    resp = await env.register(HISTORY, epoch=2)
    assert resp.entry.epoch == 2
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT


async def test_an_identical_registration_replays_within_one_incarnation(env: Env) -> None:
    await env.engine("d0")
    lease_id = await env.lease(conv="c1")
    first = await env.stub.RegisterEntry(env.entry_request(HISTORY, lease_id=lease_id, request_id="rq-a"))
    again = env.entry_request(HISTORY, lease_id=lease_id, request_id="rq-b")
    again.entry.engine_request_id = first.entry.engine_request_id
    replay = await env.stub.RegisterEntry(again)  # same content, another request id: not a conflict
    assert replay.replayed and replay.entry.engine_incarnation == first.entry.engine_incarnation


async def test_a_restart_registered_through_another_replica_is_seen_from_the_watch(env: Env) -> None:
    first = await env.engine("d0")
    old = await env.register(HISTORY)
    # Another registry replica registered the new process: this one learns it from its store watch only.
    node = await env.lease(tenant="", engine_id="d0", kind=lease_pb2.LEASE_KIND_NODE)
    record = types_pb2.Engine()
    record.CopyFrom(first)
    record.node_lease_id = node
    await env.store.put(env.keys.engine("d0"), record.SerializeToString())
    async with asyncio.timeout(10):
        while env.app.index.engines["d0"].node_lease_id != node:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.01)
    got = await env.lookup(HISTORY)
    if got.verdict != V.LOOKUP_VERDICT_NOT_FOUND:  # unless the engine sweep already dropped it
        assert got.verdict == V.LOOKUP_VERDICT_ENGINE_RESTARTED and not got.HasField("location")
    # The engine sweep (every 2 s) deletes it and revokes its lease.
    async with asyncio.timeout(10):
        while (old.entry.lease_id, types_pb2.REVOKE_REASON_ENGINE_GONE) not in env.releaser.revoked:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.05)
    assert ("acme", MODEL, "c1") not in env.app.index.entries
