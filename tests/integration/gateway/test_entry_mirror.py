"""The gateway's WatchEntries-fed copy of the registry's entries, against the real registry and lease manager."""

from __future__ import annotations

import asyncio

from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.gateway.mirror import EntryMirror
from tests.fixtures.gateway_stack import LONG, reference, turn

from .conftest import MODEL, Stack

TENANT = "acme"


def lookups(stack: Stack, source: str) -> float:
    value = stack.gateway.core.metrics.registry.get_sample_value("kvbridge_gateway_lookups_total", {"source": source})
    return value or 0.0


def mirror_of(stack: Stack) -> EntryMirror:
    mirror = stack.gateway.core.mirror
    assert mirror is not None, "the entry mirror is on by default"
    return mirror


async def wait_for_epoch(stack: Stack, conv: str, *, present: bool = True) -> None:
    """Until the mirror holds (or no longer holds) the entry the registry holds for ``conv``."""
    mirror = mirror_of(stack)
    async with asyncio.timeout(10):
        while True:
            held = mirror._entries.get((TENANT, MODEL, conv))
            if not present and held is None:
                return
            if present and held is not None and mirror.in_sync():
                stored = await stack.gateway.core.control.entry_epoch(tenant=TENANT, model=MODEL, conversation_key=conv)
                if held.entry.epoch == stored:
                    return
            await asyncio.sleep(0.02)


async def test_a_later_turn_is_looked_up_in_the_mirror_and_answers_as_without_reuse(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs, conv="m1")
    assert verdict == "miss;tokens=0"
    registry_before = lookups(stack, "registry")
    for i in range(2):
        await wait_for_epoch(stack, "m1")
        mirror_before = lookups(stack, "mirror")
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"more {i}"}]
        answer, verdict = await turn(stack, msgs, conv="m1")
        assert verdict.startswith("hit;tokens="), verdict
        assert lookups(stack, "mirror") == mirror_before + 1
        assert answer == await reference(stack, msgs)
    assert lookups(stack, "registry") == registry_before  # no round trip on these turns


def tokenized(stack: Stack) -> float:
    samples = stack.gateway.core.metrics.registry.get_sample_value
    return sum(samples("kvbridge_gateway_tokenize_total", {"path": p}) or 0.0 for p in ("local", "engine", "request"))


async def test_a_new_conversation_goes_to_p_without_tokenizing_or_asking_the_registry(stack: Stack) -> None:
    """The copy is in sync and holds no entry under the key: nothing to reuse, so no ids, no hashes, no
    round trip before P. The next turn still hits (its ids are computed as before)."""
    mirror = mirror_of(stack)
    async with asyncio.timeout(10):
        while not mirror.in_sync():  # noqa: ASYNC110 - polling another component
            await asyncio.sleep(0.02)
    registry_before, mirror_before, tokenized_before = (
        lookups(stack, "registry"),
        lookups(stack, "mirror"),
        tokenized(stack),
    )
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs, conv="new-1")
    assert verdict == "miss;tokens=0"
    assert answer == await reference(stack, msgs)
    assert lookups(stack, "registry") == registry_before and lookups(stack, "mirror") == mirror_before + 1
    assert tokenized(stack) == tokenized_before
    await wait_for_epoch(stack, "new-1")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then"}]
    answer, verdict = await turn(stack, msgs, conv="new-1")
    assert verdict.startswith("hit;tokens="), verdict
    assert tokenized(stack) == tokenized_before + 1
    assert answer == await reference(stack, msgs)


async def test_a_deleted_entry_leaves_the_mirror_and_the_turn_asks_the_registry(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="m2")
    await wait_for_epoch(stack, "m2")
    await stack.gateway.core.control.delete_entry(tenant=TENANT, model=MODEL, conversation_key="m2")
    await wait_for_epoch(stack, "m2", present=False)
    registry_before = lookups(stack, "registry")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
    answer, verdict = await turn(stack, msgs, conv="m2")
    assert verdict == "miss;tokens=0"
    assert lookups(stack, "registry") == registry_before + 1
    assert answer == await reference(stack, msgs)


async def test_a_consumed_entry_still_in_the_mirror_falls_back_to_the_registry(stack: Stack) -> None:
    """A stale copy of an entry a previous turn already pulled (single-use) is declined here; the registry,
    asked next, has the newer one."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="m3")
    await wait_for_epoch(stack, "m3")
    mirror = mirror_of(stack)
    stale = mirror._entries[(TENANT, MODEL, "m3")]
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "one"}]
    answer, verdict = await turn(stack, msgs, conv="m3")  # consumes the first entry, registers a second
    assert verdict.startswith("hit;")
    await wait_for_epoch(stack, "m3")
    mirror._entries[(TENANT, MODEL, "m3")] = stale  # as if the watch had not delivered the second one yet
    registry_before = lookups(stack, "registry")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "two"}]
    answer, verdict = await turn(stack, msgs, conv="m3")
    assert verdict.startswith("hit;"), verdict
    assert lookups(stack, "registry") == registry_before + 1
    assert answer == await reference(stack, msgs)


async def test_the_mirror_loads_a_multi_page_snapshot(stack: Stack) -> None:
    """More entries than one snapshot page (500): a gateway started now loads them all before answering."""
    assert stack.registry is not None
    control = stack.gateway.core.control
    pages: list[registry_pb2.WatchEntriesResponse] = []
    for i in range(620):  # registered directly: what D's connectors would have registered
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant=f"t{i % 4}", model=MODEL, conversation_key=f"bulk-{i}"),
            engine_id="d0",
            engine_request_id=f"r{i}",
            block_ids=[],
            block_size=16,
            token_count=16,
            block_hashes=[bytes([i % 256]) * 16],
            chain_stride=1,
            final_block_hash=bytes([i % 256]) * 16,
            lease_id=await control.grant_lease(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant=f"t{i % 4}",
                engine_id="d0",
                model=MODEL,
                conversation_key=f"bulk-{i}",
                retained_tokens=16,
                ttl_s=60,
            ),
            epoch=1,
        )
        entry.block_ids.add(ids=[i])
        await control.register_entry(entry)
    async for message in control.watch_entries(progress_interval_s=1.0, lifetime_s=10.0):
        pages.append(message)
        if message.snapshot_complete:
            break
    assert len(pages) >= 2 and not any(p.snapshot_complete for p in pages[:-1])
    assert sum(len(p.events) for p in pages) >= 620
    fresh = EntryMirror(max_entries=10_000, stale_after_s=3.0)
    for p in pages:
        fresh.apply(p)
    assert fresh.in_sync() and len(fresh) >= 620


async def test_an_idle_mirror_stays_in_sync_on_progress_heartbeats(stack: Stack) -> None:
    """No entry changes for longer than entry_mirror_stale_after_s (3 s): the registry's progress
    heartbeats keep the copy answering."""
    mirror = mirror_of(stack)
    async with asyncio.timeout(10):
        while not mirror.in_sync():  # noqa: ASYNC110 - polling another component
            await asyncio.sleep(0.02)
    revision = mirror.revision
    await asyncio.sleep(stack.gateway.core.settings.entry_mirror_stale_after_s + 1.0)
    assert mirror.in_sync() and mirror.revision >= revision
