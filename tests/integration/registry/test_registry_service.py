"""RegistryService through real gRPC over loopback, on MemoryStore and on real etcd."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvbridge.errors import from_rpc_error
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from .conftest import BLOCK, Env

V = registry_pb2.LookupVerdict
HISTORY = list(range(1000, 1000 + 403))  # 100 full blocks + 3 tokens


async def expect_error(call: Awaitable[object], code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = from_rpc_error(info.value)
    assert (info.value.code(), err.reason) == (code, reason), info.value.details()


async def test_append_only_history_gets_full_reuse(env: Env) -> None:
    await env.engine()
    resp = await env.register(HISTORY)
    # 100 blocks, within the default 128-block exact tail: no checkpoints, every hash but the final in the tail.
    assert resp.entry.chain_stride == 4 and len(resp.entry.block_hashes) == 0
    assert resp.entry.tail_start_block == 0 and len(resp.entry.tail_block_hashes) == 16 * 99
    assert resp.entry.final_block_hash
    new_prompt = [*HISTORY, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    got = await env.lookup(new_prompt, min_tokens=16)
    assert got.verdict == V.LOOKUP_VERDICT_HIT
    assert got.verified_tokens == 400
    assert got.prompt_block_tokens == len(new_prompt) // BLOCK * BLOCK
    loc = got.location
    assert loc.engine.kv_host == "10.0.0.5" and loc.engine.kv_port == 5600
    assert list(loc.block_ids[0].ids) == list(range(100))
    assert loc.conversation_key == "c1" and loc.epoch == 1


@pytest.mark.parametrize(
    ("name", "edit", "expected_blocks"),
    [
        # 100 blocks, all within the default exact tail (chain_exact_tail_blocks 128): exact to the block.
        ("edited at token 150", lambda h: [*h[:150], 7, *h[151:]], 37),  # block 37 changed
        ("truncated to 250 tokens", lambda h: h[:250], 62),  # 62 full blocks
        ("reasoning stripped after 322", lambda h: h[:322] + h[360:], 80),
        ("edited in block 0", lambda h: [9, *h[1:]], 0),
    ],
)
async def test_changed_history_reuses_only_common_prefix(
    env: Env, name: str, edit: Callable[[list[int]], list[int]], expected_blocks: int
) -> None:
    await env.engine()
    await env.register(HISTORY)
    got = await env.lookup(edit(HISTORY))
    if expected_blocks == 0:
        assert got.verdict == V.LOOKUP_VERDICT_MISMATCH and got.verified_tokens == 0
        return
    assert got.verdict == V.LOOKUP_VERDICT_HIT, name
    assert got.verified_tokens == expected_blocks * BLOCK
    assert list(got.location.block_ids[0].ids) == list(range(expected_blocks))


async def test_other_tenant_gets_nothing(env: Env) -> None:
    await env.engine()
    await env.register(HISTORY)
    # Same key and even the same hashes: another tenant's lookup sees nothing.
    assert (await env.lookup(HISTORY, tenant="beta", chain_tenant="acme")).verdict == V.LOOKUP_VERDICT_NOT_FOUND
    from .conftest import chain

    keyless = await env.stub.LookupEntry(
        registry_pb2.LookupEntryRequest(
            tenant="beta", model=env_model(), block_hashes=chain(HISTORY, "acme"), block_size=BLOCK
        )
    )
    assert keyless.verdict == V.LOOKUP_VERDICT_NOT_FOUND


def env_model() -> str:
    from .conftest import MODEL

    return MODEL


async def test_content_addressed_lookup_finds_fork(env: Env) -> None:
    await env.engine()
    system = list(range(5000, 5000 + 64))  # shared system prompt + tools, 16 blocks
    await env.register([*system, *range(1, 41)], conv="conv-a")
    await env.register([*system, *range(101, 121)], conv="conv-b")
    fork = [*system, *range(1, 21), 999, 998, 997, 996]
    from .conftest import chain

    got = await env.stub.LookupEntry(
        registry_pb2.LookupEntryRequest(tenant="acme", model=env_model(), block_hashes=chain(fork), block_size=BLOCK)
    )
    assert got.verdict == V.LOOKUP_VERDICT_HIT
    assert got.location.conversation_key == "conv-a"
    # 21 blocks match conv-a, proven exactly (the whole entry is within the exact tail).
    assert got.verified_tokens == 84
    other = await env.stub.LookupEntry(
        registry_pb2.LookupEntryRequest(
            tenant="beta", model=env_model(), block_hashes=chain(fork, "beta"), block_size=BLOCK
        )
    )
    assert other.verdict == V.LOOKUP_VERDICT_NOT_FOUND


async def test_epochs_supersede_and_stale_is_refused(env: Env) -> None:
    await env.engine()
    first = await env.register(HISTORY[:200], epoch=1)
    second = await env.register(HISTORY, epoch=2)
    assert second.superseded_epoch == 1
    await env.app.revoker.drain()
    assert (first.entry.lease_id, types_pb2.REVOKE_REASON_SUPERSEDED) in env.releaser.revoked
    await expect_error(env.register(HISTORY[:300], epoch=1), grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH")
    got = await env.lookup(HISTORY)
    assert got.verified_tokens == 400 and got.location.epoch == 2


async def test_idempotent_replay(env: Env) -> None:
    await env.engine()
    lease = await env.lease(conv="c1")
    request = env.entry_request(HISTORY, lease_id=lease, request_id="retry-me")
    first = await env.stub.RegisterEntry(request)
    again = await env.stub.RegisterEntry(request)
    assert not first.replayed and again.replayed
    assert again.entry == first.entry
    changed = env.entry_request(HISTORY[:100], lease_id=lease, request_id="retry-me", epoch=2)
    await expect_error(env.stub.RegisterEntry(changed), grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_CONFLICT")


async def test_preconditions(env: Env) -> None:
    await expect_error(env.register(HISTORY), grpc.StatusCode.FAILED_PRECONDITION, "ENGINE_NOT_FOUND")
    await env.engine()
    await expect_error(env.register(HISTORY, lease_id=424242), grpc.StatusCode.FAILED_PRECONDITION, "LEASE_NOT_FOUND")
    foreign = await env.lease(tenant="beta")
    await expect_error(env.register(HISTORY, lease_id=foreign), grpc.StatusCode.FAILED_PRECONDITION, "LEASE_MISMATCH")


async def test_bad_input_is_invalid_argument_with_reason(env: Env) -> None:
    await env.engine()
    lease = await env.lease()
    good = env.entry_request(HISTORY, lease_id=lease)
    cases = {
        "request_id": lambda r: setattr(r, "request_id", "bad id!"),
        "entry.key.conversation_key": lambda r: setattr(r.entry.key, "conversation_key", "tab\there"),
        "entry.block_size": lambda r: setattr(r.entry, "block_size", 2048),
        "entry.block_hashes[3]": lambda r: r.entry.block_hashes.__setitem__(3, b"short"),
        "entry.block_ids[0]": lambda r: r.entry.block_ids[0].ids.append(5),
        "entry.epoch": lambda r: setattr(r.entry, "epoch", 0),
        "entry.engine_id": lambda r: setattr(r.entry, "engine_id", "x" * 200),
    }
    for field, mutate in cases.items():
        bad = registry_pb2.RegisterEntryRequest()
        bad.CopyFrom(good)
        mutate(bad)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.stub.RegisterEntry(bad)
        err = from_rpc_error(info.value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert err.reason == "INVALID_FIELD" and err.metadata["field"] == field
    await expect_error(
        env.stub.LookupEntry(
            registry_pb2.LookupEntryRequest(tenant="acme", model="m", block_size=4, block_hashes=[b"x" * 16] * 40000)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "TOO_LARGE",
    )


async def test_verdicts(env: Env) -> None:
    await env.engine()
    await env.register(HISTORY)
    assert (await env.lookup(HISTORY, conv="nope")).verdict == V.LOOKUP_VERDICT_NOT_FOUND
    below = await env.lookup(HISTORY, min_tokens=1000)
    assert below.verdict == V.LOOKUP_VERDICT_BELOW_THRESHOLD and below.verified_tokens == 400
    from .conftest import chain

    size = await env.stub.LookupEntry(
        registry_pb2.LookupEntryRequest(
            tenant="acme", model=env_model(), conversation_key="c1", block_hashes=chain(HISTORY), block_size=8
        )
    )
    assert size.verdict == V.LOOKUP_VERDICT_BLOCK_SIZE_MISMATCH
    await env.stub.DeregisterEngine(registry_pb2.DeregisterEngineRequest(engine_id="d0"))
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_ENGINE_GONE


async def test_get_list_delete_watch(env: Env) -> None:
    await env.engine()
    watch = env.stub.WatchEntries(registry_pb2.WatchEntriesRequest())
    stream = watch.__aiter__()
    snap = await asyncio.wait_for(stream.__anext__(), 10)
    assert snap.snapshot_complete and not snap.events
    # Stamped with when the registry had it from its store: a watcher's copy is that old (issue 30 item 8).
    assert abs(snap.as_of.ToNanoseconds() / 1e9 - time.time()) < 5
    for i in range(5):
        await env.register(HISTORY[: 40 + i * 8], conv=f"c{i}")
    page1 = await env.stub.ListEntries(registry_pb2.ListEntriesRequest(tenant="acme", page_size=3))
    assert len(page1.entries) == 3 and page1.next_page_token
    page2 = await env.stub.ListEntries(
        registry_pb2.ListEntriesRequest(tenant="acme", page_size=3, page_token=page1.next_page_token)
    )
    assert len(page2.entries) == 2 and not page2.next_page_token
    await expect_error(
        env.stub.ListEntries(
            registry_pb2.ListEntriesRequest(
                tenant="acme", model=env_model(), page_size=3, page_token=page1.next_page_token
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    key = registry_pb2.EntryKey(tenant="acme", model=env_model(), conversation_key="c0")
    got = await env.stub.GetEntry(registry_pb2.GetEntryRequest(key=key))
    assert got.entry.token_count == 40
    deleted = await env.stub.DeleteEntry(
        registry_pb2.DeleteEntryRequest(key=key, reason=types_pb2.REVOKE_REASON_CLIENT_CLOSED)
    )
    assert deleted.entry.token_count == 40
    await expect_error(
        env.stub.GetEntry(registry_pb2.GetEntryRequest(key=key)), grpc.StatusCode.NOT_FOUND, "ENTRY_NOT_FOUND"
    )
    assert (await env.lookup(HISTORY, conv="c0")).verdict == V.LOOKUP_VERDICT_NOT_FOUND
    seen: list[tuple[int, str]] = []
    while len(seen) < 6:
        msg = await asyncio.wait_for(stream.__anext__(), 10)
        seen += [(e.type, e.entry.key.conversation_key) for e in msg.events]
        assert msg.as_of.ToNanoseconds() >= snap.as_of.ToNanoseconds()
    assert seen[-1] == (registry_pb2.EntryEvent.TYPE_DELETE, "c0")
    watch.cancel()


async def test_tenant_cap_evicts_oldest_idle(store) -> None:
    from .conftest import start_env, stop_env

    env = await start_env(store, max_entries_per_tenant=3)
    try:
        await env.engine()
        leases = [(await env.register(HISTORY[:40], conv=f"c{i}")).entry.lease_id for i in range(3)]
        await env.lookup(HISTORY[:40], conv="c0")  # c0 used: c1 is now the oldest idle
        await env.register(HISTORY[:40], conv="c3")
        assert (await env.lookup(HISTORY[:40], conv="c1")).verdict == V.LOOKUP_VERDICT_NOT_FOUND
        assert (await env.lookup(HISTORY[:40], conv="c0")).verdict == V.LOOKUP_VERDICT_HIT
        await env.app.revoker.drain()
        assert (leases[1], types_pb2.REVOKE_REASON_BUDGET) in env.releaser.revoked
    finally:
        await stop_env(env)


async def test_engine_whose_node_lease_ended_is_gone(env: Env) -> None:
    engine = await env.engine()
    await env.register(HISTORY)
    await env.store.delete(env.keys.lease(engine.node_lease_id))  # the lease manager ended the node lease
    assert await env.app.registry.engines.sweep_engines() == 1
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_ENGINE_GONE
    await expect_error(
        env.stub.GetEngine(registry_pb2.GetEngineRequest(engine_id="d0")), grpc.StatusCode.NOT_FOUND, "ENGINE_NOT_FOUND"
    )


async def test_packed_chain_lookup_answers_like_the_repeated_form(env: Env) -> None:
    from .conftest import MODEL, chain

    await env.engine()
    await env.register(HISTORY)
    for prompt in ([*HISTORY, 7, 8, 9, 10], [*HISTORY[:150], 7, *HISTORY[151:]], [9, *HISTORY[1:]]):
        hashes = chain(prompt)
        for conv in ("c1", ""):  # keyed and content-addressed
            request = functools.partial(
                registry_pb2.LookupEntryRequest, tenant="acme", model=MODEL, conversation_key=conv, block_size=BLOCK
            )
            repeated = await env.stub.LookupEntry(request(block_hashes=hashes))
            packed = await env.stub.LookupEntry(request(block_hashes_packed=b"".join(hashes)))
            assert packed == repeated
    both = registry_pb2.LookupEntryRequest(
        tenant="acme",
        model=MODEL,
        conversation_key="c1",
        block_size=BLOCK,
        block_hashes=chain(HISTORY),
        block_hashes_packed=b"".join(chain(HISTORY)),
    )
    await expect_error(env.stub.LookupEntry(both), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")


async def test_sdk_lookup_sends_the_packed_chain_and_gets_the_same_answer(env: Env) -> None:
    from kvbridge.sdk.registry import RegistryClient

    from .conftest import MODEL, chain

    await env.engine()
    await env.register(HISTORY)
    prompt = [*HISTORY, 7, 8, 9, 10]
    expected = await env.lookup(prompt, min_tokens=16)
    async with RegistryClient(env.app.address) as client:
        got = await client.lookup(
            tenant="acme",
            model=MODEL,
            conversation_key="c1",
            block_hashes=chain(prompt),
            block_size=BLOCK,
            min_tokens=16,
        )
    assert got == expected and got.verdict == V.LOOKUP_VERDICT_HIT
