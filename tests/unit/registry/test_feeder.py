"""The index feeder's supervision: a follow task that fails or whose watch goes silent is restarted,
and the index stops being fresh while it does not hear from the store (real MemoryStore, no mocks of it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import WatchBatch
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.feeder import IndexFeeder
from kvbridge_services.registry.index import RegistryIndex

KEYS = KeyLayout()


class FaultyWatchStore(MemoryStore):
    """A MemoryStore whose first watches misbehave: ``raise_first`` raise a bug's error, ``hang_first`` never
    answer (a frozen store); later ones are the real watch."""

    def __init__(self, *, raise_first: int = 0, hang_first: int = 0) -> None:
        super().__init__()
        self.raise_first, self.hang_first, self.watches = raise_first, hang_first, 0

    async def watch_prefix(self, prefix: bytes, **kw: Any) -> AsyncIterator[WatchBatch]:
        self.watches += 1
        if self.watches <= self.raise_first:
            raise RuntimeError("a bug in the watch path")
        if self.watches <= self.raise_first + self.hang_first:
            await asyncio.Event().wait()
        async for batch in super().watch_prefix(prefix, **kw):
            yield batch


async def put_entry(store: MemoryStore, conv: str) -> None:
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key=conv),
        engine_id="d0",
        block_size=4,
        token_count=4,
    )
    await store.put(KEYS.entry("acme", "m", conv), entry.SerializeToString())


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.02)


async def test_a_follow_task_that_fails_is_restarted_from_a_fresh_list() -> None:
    store = FaultyWatchStore(raise_first=2)
    index = RegistryIndex(max_lag_s=1.0)
    feeder = IndexFeeder(store, KEYS, index, progress_interval_s=0.1, restart_after_s=5.0)
    await feeder.start()
    try:
        await put_entry(store, "c1")
        await wait_for(lambda: ("acme", "m", "c1") in index.entries and store.watches == 3)
        assert feeder.restarts == 2
        await put_entry(store, "c2")  # and it keeps following
        await wait_for(lambda: ("acme", "m", "c2") in index.entries)
        assert index.fresh()
    finally:
        await feeder.stop()
        await store.close()


async def test_a_silent_watch_makes_the_index_stale_then_is_restarted() -> None:
    store = FaultyWatchStore(hang_first=1)
    index = RegistryIndex(max_lag_s=0.3)
    feeder = IndexFeeder(store, KEYS, index, progress_interval_s=0.075, restart_after_s=1.0)
    await feeder.start()
    try:
        assert index.fresh()  # the list counts as hearing from the store
        await wait_for(lambda: not index.fresh())  # the watch never answers
        assert feeder.restarts == 0
        await wait_for(lambda: feeder.restarts == 1)  # silent past restart_after_s: a new watch
        await wait_for(index.fresh)  # its progress notifications make the index fresh again
        await put_entry(store, "c1")
        await wait_for(lambda: ("acme", "m", "c1") in index.entries)
    finally:
        await feeder.stop()
        await store.close()


async def test_progress_notifications_keep_an_idle_index_fresh() -> None:
    store = MemoryStore()
    index = RegistryIndex(max_lag_s=0.3)
    feeder = IndexFeeder(store, KEYS, index, progress_interval_s=0.075, restart_after_s=5.0)
    await feeder.start()
    try:
        for _ in range(10):  # 1 s without a single change: fresh throughout
            await asyncio.sleep(0.1)
            assert index.fresh(), index.lag_s()
        assert feeder.restarts == 0
    finally:
        await feeder.stop()
        await store.close()
