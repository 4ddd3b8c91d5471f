"""One contract, every Store backend: the same tests run on MemoryStore and EtcdStore."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from kvbridge_services.common.store import (
    Compacted,
    Compare,
    CompareTarget,
    Delete,
    EventType,
    Get,
    LeaseNotFound,
    Put,
    Store,
    StoreUnavailable,
    WatchBatch,
    WatchEvent,
)
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.common.store.memory import MemoryStore
from tests.fixtures.etcd import EtcdServer

WAIT_S = 15.0  # generous bound for anything that waits on etcd's lease clock


@dataclass
class Harness:
    store: Store
    backend: str
    compact: Callable[[int], object]
    make_unreachable: Callable[[], object]


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        mem = MemoryStore()
        yield Harness(mem, "memory", mem.compact, lambda: None)
        await mem.close()
        return
    server: EtcdServer = request.getfixturevalue("etcd_server")
    etcd = EtcdStore([server.endpoint], timeout=5.0)
    yield Harness(etcd, "etcd", etcd.compact, server.kill)
    await etcd.close()


@pytest.fixture
def store(harness: Harness) -> Store:
    return harness.store


async def next_batch(it: AsyncIterator[WatchBatch], timeout: float = WAIT_S) -> WatchBatch:
    async with asyncio.timeout(timeout):
        return await anext(it)


async def collect_events(it: AsyncIterator[WatchBatch], count: int, timeout: float = WAIT_S) -> list[WatchEvent]:
    events: list[WatchEvent] = []
    async with asyncio.timeout(timeout):
        while len(events) < count:
            events.extend((await anext(it)).events)
    return events


# ---------------------------------------------------------------- key/value


async def test_put_get_delete(store: Store) -> None:
    rev1 = await store.put(b"/c/k", b"v1")
    kv = await store.get(b"/c/k")
    assert kv is not None and kv.value == b"v1"
    assert (kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (rev1, rev1, 1, 0)
    rev2 = await store.put(b"/c/k", b"v2")
    kv2 = await store.get(b"/c/k")
    assert rev2 > rev1 and kv2 is not None
    assert (kv2.value, kv2.create_revision, kv2.mod_revision, kv2.version) == (b"v2", rev1, rev2, 2)
    assert await store.current_revision() == rev2
    assert await store.delete(b"/c/k") == 1
    assert await store.get(b"/c/k") is None
    assert await store.delete(b"/c/k") == 0


async def test_range_prefix_pagination_and_prefix_delete(store: Store) -> None:
    for i in range(7):
        await store.put(f"/c/r/{i}".encode(), f"v{i}".encode())
    await store.put(b"/c/r0", b"outside")  # shares the bytes "/c/r" but not the prefix "/c/r/"
    last_rev = await store.put(b"/c/s/x", b"outside")
    seen: list[bytes] = []
    after: bytes | None = None
    while True:
        page, rev = await store.range_prefix(b"/c/r/", start_after=after, limit=3)
        assert rev == last_rev
        if not page:
            break
        assert len(page) <= 3
        seen.extend(kv.key for kv in page)
        after = page[-1].key
    assert seen == [f"/c/r/{i}".encode() for i in range(7)]
    keys_only, _ = await store.range_prefix(b"/c/r/", keys_only=True)
    assert [kv.value for kv in keys_only] == [b""] * 7 and keys_only[0].version == 1
    assert await store.delete(b"/c/r/", prefix=True) == 7
    assert (await store.range_prefix(b"/c/r/"))[0] == []
    assert await store.get(b"/c/r0") is not None


# --------------------------------------------------------------------- txn


async def test_txn_success_and_failure_branches(store: Store) -> None:
    created = await store.txn([Compare.absent(b"/c/t")], [Put(b"/c/t", b"1"), Get(b"/c/t")], [Get(b"/c/t")])
    assert created.succeeded and created.gets[0] is not None and created.gets[0].value == b"1"
    again = await store.txn([Compare.absent(b"/c/t")], [Put(b"/c/t", b"2")], [Get(b"/c/t"), Get(b"/c/none")])
    assert not again.succeeded
    assert again.revision == created.revision  # a read-only branch writes nothing
    assert again.gets[0] is not None and again.gets[0].value == b"1" and again.gets[1] is None
    cas = await store.txn(
        [Compare.mod_revision_is(b"/c/t", created.revision)], [Put(b"/c/t", b"3"), Delete(b"/c/other")]
    )
    assert cas.succeeded and cas.revision == created.revision + 1
    kv = await store.get(b"/c/t")
    assert kv is not None and kv.value == b"3" and kv.version == 2


@pytest.mark.parametrize(
    ("target", "op", "operand", "expected"),
    [
        (CompareTarget.VALUE, "==", b"x", True),
        (CompareTarget.VALUE, "!=", b"x", False),
        (CompareTarget.VALUE, "<", b"y", True),
        (CompareTarget.VALUE, ">", b"y", False),
        (CompareTarget.VERSION, "==", 2, True),
        (CompareTarget.VERSION, ">", 2, False),
        (CompareTarget.CREATE, "<", 10**9, True),
        (CompareTarget.CREATE, "==", 0, False),
        (CompareTarget.MOD, ">", 0, True),
        (CompareTarget.MOD, "<", 1, False),
        (CompareTarget.LEASE, "==", 0, True),
        (CompareTarget.LEASE, "!=", 0, False),
    ],
)
async def test_txn_compare_targets(
    store: Store, target: CompareTarget, op: str, operand: int | bytes, expected: bool
) -> None:
    await store.put(b"/c/cmp", b"w")
    await store.put(b"/c/cmp", b"x")  # version 2
    result = await store.txn([Compare(b"/c/cmp", target, op, operand)], [Get(b"/c/cmp")])  # type: ignore[arg-type]
    assert result.succeeded is expected


async def test_txn_compare_on_missing_key(store: Store) -> None:
    assert (await store.txn([Compare(b"/c/missing", CompareTarget.VERSION, "==", 0)], [])).succeeded
    assert (await store.txn([Compare(b"/c/missing", CompareTarget.CREATE, "==", 0)], [])).succeeded
    assert not (await store.txn([Compare(b"/c/missing", CompareTarget.VALUE, "==", b"")], [])).succeeded


async def test_txn_compare_lease_target(store: Store) -> None:
    lease = await store.grant_lease(30)
    await store.put(b"/c/leased", b"v", lease=lease)
    assert (await store.txn([Compare(b"/c/leased", CompareTarget.LEASE, "==", lease)], [])).succeeded
    assert (await store.get(b"/c/leased")).lease == lease  # type: ignore[union-attr]
    await store.revoke_lease(lease)


# ------------------------------------------------------------------ leases


async def test_lease_expiry_deletes_attached_keys_in_one_revision(store: Store) -> None:
    lease = await store.grant_lease(1)
    await store.put(b"/c/l/a", b"1", lease=lease)
    await store.put(b"/c/l/b", b"2", lease=lease)
    await store.put(b"/c/l/keep", b"3")
    watch = store.watch_prefix(b"/c/l/")
    try:
        deletes = await collect_events(watch, 2)
    finally:
        await watch.aclose()  # type: ignore[attr-defined]
    assert {e.kv.key for e in deletes} == {b"/c/l/a", b"/c/l/b"}
    assert all(e.type is EventType.DELETE for e in deletes)
    assert len({e.kv.mod_revision for e in deletes}) == 1
    assert await store.get(b"/c/l/keep") is not None
    assert await store.lease_ttl(lease) == -1
    with pytest.raises(LeaseNotFound):
        await store.refresh_lease(lease)


async def test_revoke_deletes_keys_and_unknown_is_ignored(store: Store) -> None:
    lease = await store.grant_lease(60)
    assert 0 < await store.lease_ttl(lease) <= 60
    await store.put(b"/c/rv/a", b"1", lease=lease)
    await store.revoke_lease(lease)
    assert await store.get(b"/c/rv/a") is None
    assert await store.lease_ttl(lease) == -1
    await store.revoke_lease(lease)  # again: ignored
    with pytest.raises(LeaseNotFound):
        await store.refresh_lease(lease)
    with pytest.raises(LeaseNotFound):
        await store.put(b"/c/rv/b", b"2", lease=lease)


async def test_refresh_keeps_lease_alive(store: Store) -> None:
    lease = await store.grant_lease(2)
    await store.put(b"/c/rf", b"1", lease=lease)
    for _ in range(4):  # 3.2 s in all, well past the 2 s TTL
        await asyncio.sleep(0.8)
        assert await store.refresh_lease(lease) == 2
    assert await store.get(b"/c/rf") is not None
    assert await store.lease_ttl(lease) >= 1


# ------------------------------------------------------------------- watch


async def test_watch_from_past_revision_replays_in_order(store: Store) -> None:
    await store.put(b"/c/w/a", b"1")
    rev_b = await store.put(b"/c/w/b", b"2")
    await store.put(b"/c/other", b"x")
    rev_del = await store.txn([], [Delete(b"/c/w/a")])
    watch = store.watch_prefix(b"/c/w/", start_revision=rev_b)
    try:
        events = await collect_events(watch, 2)
        assert [(e.type, e.kv.key, e.kv.mod_revision) for e in events] == [
            (EventType.PUT, b"/c/w/b", rev_b),
            (EventType.DELETE, b"/c/w/a", rev_del.revision),
        ]
        assert events[1].prev_kv is not None and events[1].prev_kv.value == b"1"
        live_rev = await store.put(b"/c/w/c", b"3")
        live = await collect_events(watch, 1)
        assert [(e.kv.key, e.kv.value, e.kv.mod_revision) for e in live] == [(b"/c/w/c", b"3", live_rev)]
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_watch_from_now_sees_only_new_changes(store: Store) -> None:
    await store.put(b"/c/n/old", b"1")
    watch = store.watch_prefix(b"/c/n/")
    try:
        first = asyncio.ensure_future(next_batch(watch))
        await asyncio.sleep(0.2)  # the watch is established
        rev = await store.put(b"/c/n/new", b"2")
        batch = await first
        assert [(e.kv.key, e.kv.mod_revision) for e in batch.events] == [(b"/c/n/new", rev)]
        assert batch.revision >= rev
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_a_watch_without_previous_values_still_sees_puts_and_deletes(store: Store) -> None:
    """``prev_kv=False`` (the registry's index feeder): a delete still names its key and revision; etcd leaves the
    previous value out, the embedded store may keep it."""
    first = await store.put(b"/c/p/a", b"1")
    deleted_at = await store.delete(b"/c/p/a") and await store.current_revision()
    watch = store.watch_prefix(b"/c/p/", start_revision=first, prev_kv=False)
    try:
        put, delete = await collect_events(watch, 2)
    finally:
        await watch.aclose()  # type: ignore[attr-defined]
    assert (put.type, put.kv.key, put.kv.value, put.kv.mod_revision) == (EventType.PUT, b"/c/p/a", b"1", first)
    assert (delete.type, delete.kv.key, delete.kv.mod_revision) == (EventType.DELETE, b"/c/p/a", deleted_at)


async def test_watch_compacted_revision_raises(harness: Harness) -> None:
    store = harness.store
    first = await store.put(b"/c/cp/a", b"1")
    for i in range(5):
        await store.put(b"/c/cp/a", str(i).encode())
    latest = await store.current_revision()
    result = harness.compact(latest)
    if asyncio.iscoroutine(result):
        await result
    watch = store.watch_prefix(b"/c/cp/", start_revision=first)
    with pytest.raises(Compacted) as info:
        await next_batch(watch)
    assert info.value.compact_revision >= first + 1
    # Re-list and watch from the list's revision: works.
    _, rev = await store.range_prefix(b"/c/cp/")
    watch2 = store.watch_prefix(b"/c/cp/", start_revision=rev + 1)
    try:
        put_rev = await store.put(b"/c/cp/b", b"x")
        assert [e.kv.mod_revision for e in await collect_events(watch2, 1)] == [put_rev]
    finally:
        await watch2.aclose()  # type: ignore[attr-defined]


async def test_progress_notifications_on_idle_watch(store: Store) -> None:
    watch = store.watch_prefix(b"/c/idle/", progress_interval_s=0.2)
    try:
        await asyncio.sleep(0.1)
        other_rev = await store.put(b"/c/elsewhere", b"x")
        async with asyncio.timeout(WAIT_S):
            while True:
                batch = await anext(watch)
                assert batch.events == []
                if batch.revision >= other_rev:
                    break
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


# ------------------------------------------------------------------ deadline


async def test_unreachable_store_raises_unavailable_within_deadline(harness: Harness) -> None:
    if harness.backend == "memory":
        await harness.store.close()  # the embedded store is unreachable only once closed
    else:
        harness.make_unreachable()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await harness.store.get(b"/c/k", timeout=1.0)
    with pytest.raises(StoreUnavailable):
        await harness.store.put(b"/c/k", b"v", timeout=1.0)
    assert time.monotonic() - started < 2 * 1.0 + 1.0  # generous: two 1 s deadlines
