"""Keeps the in-memory index equal to the store: list, then watch from the list's revision.

On ``Compacted`` (the watch fell behind the store's history) it re-lists; on a
store outage it retries with backoff and resumes from the last revision seen,
so every replica converges on the same state.

Freshness (docs/adr/0010): the watch asks the store for a progress notification
when idle (every ``max_lag_s / 4``), and every answer (events or progress) marks
the index as heard from; the index answers no hit once it has not heard from
the store for ``max_lag_s``. The follow task is supervised: an unexpected error
or a watch silent for ``restart_after_s`` (a frozen store, a dead connection)
cancels it, and it starts again, from a fresh list after an unexpected error,
with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import unquote

from kvbridge.backoff import Backoff, retry
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Compacted, EventType, KeyValue, Store, StoreError
from kvbridge_services.common.tasks import cancel_and_wait

from .index import RegistryIndex

log = logging.getLogger(__name__)

_PAGE = 1000
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_HEALTHY_RUN_S = 30.0  # a follow task that ran this long restarts after the shortest backoff
_STORE_FAILURES = (StoreError, TimeoutError, OSError)  # a watch or re-list retries these


def _backoff() -> Backoff:
    return Backoff(_FIRST_BACKOFF_S, _MAX_BACKOFF_S)


class IndexFeeder:
    def __init__(
        self,
        store: Store,
        keys: KeyLayout,
        index: RegistryIndex,
        *,
        timeout_s: float = 5.0,
        progress_interval_s: float = 0.5,
        restart_after_s: float = 10.0,
    ) -> None:
        self._store = store
        self._progress_s = progress_interval_s
        self._restart_after_s = restart_after_s
        self._need_relist = False
        self.restarts = 0  # follow tasks restarted by the supervisor (metrics, tests)
        self._keys = keys
        self._index = index
        self._timeout = timeout_s
        self._entries_prefix = keys.entries_prefix()
        self._engines_prefix = keys.engines_prefix()
        self._registry_prefix = keys.entries_prefix()[: -len(b"entries/")]
        self._task: asyncio.Task[None] | None = None
        self.revision = 0
        self.ready = asyncio.Event()

    async def start(self) -> None:
        """Loads the index (so lookups are answered from a full index) and starts following changes."""
        await self._relist()
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="registry-index-feeder")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _range_all(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        out: list[KeyValue] = []
        after: bytes | None = None
        revision = 0
        while True:
            kvs, rev = await self._store.range_prefix(prefix, start_after=after, limit=_PAGE, timeout=self._timeout)
            revision = revision or rev
            out.extend(kvs)
            if len(kvs) < _PAGE:
                return out, revision
            after = kvs[-1].key

    async def _relist(self) -> None:
        # One revision for the whole snapshot: read the engines and entries, then watch from the
        # lowest revision seen, so nothing that changed in between is missed (re-applying is harmless).
        engines, rev_a = await self._range_all(self._engines_prefix)
        entries, rev_b = await self._range_all(self._entries_prefix)
        self._index.clear()
        for kv in engines:
            self._apply_put(kv)
        for kv in entries:
            self._apply_put(kv)
        self.revision = min(rev_a, rev_b)
        self._need_relist = False
        self._index.heard()
        self.ready.set()
        log.info(
            "registry index loaded: %d entries, %d engines at revision %d",
            len(self._index.entries),
            len(self._index.engines),
            self.revision,
        )

    async def _supervise(self) -> None:
        """Runs the follow task; restarts it when it fails or its watch goes silent (with backoff)."""
        loop = asyncio.get_running_loop()
        backoff = _backoff()
        while True:
            started = loop.time()
            follow = loop.create_task(self._follow(), name="registry-index-follow")
            try:
                while not follow.done():
                    await asyncio.wait([follow], timeout=min(1.0, self._restart_after_s / 4))
                    if not follow.done() and self._index.lag_s() > self._restart_after_s:
                        log.warning(
                            "registry watch silent for %.1fs; restarting it from revision %d",
                            self._index.lag_s(),
                            self.revision,
                        )
                        await cancel_and_wait(follow)
                        break
                else:
                    exc = follow.exception()
                    log.error(
                        "registry index follow task ended (%r); restarting it from a fresh list in %.1fs",
                        exc,
                        backoff.upcoming_s,
                        exc_info=exc,
                    )
                    self._need_relist = True
            except asyncio.CancelledError:
                await cancel_and_wait(follow)
                raise
            self.restarts += 1
            if loop.time() - started > _HEALTHY_RUN_S:
                backoff.reset()
            await backoff.sleep()

    async def _follow(self) -> None:
        if self._need_relist:  # after an unexpected error the index may hold half a batch: start afresh
            await self._relist_until_done()
        backoff = _backoff()
        while True:
            try:
                # No previous values: a delete needs only its key, and the idempotency records under this prefix
                # (the size of an entry) are deleted thousands at a time when their window's lease expires.
                async for batch in self._store.watch_prefix(
                    self._registry_prefix,
                    start_revision=self.revision + 1,
                    progress_interval_s=self._progress_s,
                    prev_kv=False,
                ):
                    self._index.heard()
                    for event in batch.events:
                        if event.type is EventType.PUT:
                            self._apply_put(event.kv)
                        else:
                            self._apply_delete(event.kv.key, event.kv.mod_revision)
                    self.revision = max(self.revision, batch.revision)
                    backoff.reset()
            except Compacted:
                log.warning("registry watch compacted at revision %d; re-listing", self.revision)
                await self._relist_until_done()
            except _STORE_FAILURES as exc:
                delay = backoff.next_delay()
                log.warning("registry watch failed (%s); resuming from revision %d in %.1fs", exc, self.revision, delay)
                await asyncio.sleep(delay)

    async def _relist_until_done(self) -> None:
        await retry(
            self._relist,
            _backoff(),
            retry_on=_STORE_FAILURES,
            on_retry=lambda exc, delay: log.warning("registry re-list failed (%s); retry in %.1fs", exc, delay),
        )

    def _apply_put(self, kv: KeyValue) -> None:
        try:
            if kv.key.startswith(self._entries_prefix):
                self._index.put_entry(registry_pb2.Entry.FromString(kv.value), kv.mod_revision)
            elif kv.key.startswith(self._engines_prefix):
                self._index.put_engine(types_pb2.Engine.FromString(kv.value), kv.mod_revision)
        except Exception:
            log.exception("skipping unreadable registry record %r", kv.key)

    def _apply_delete(self, key: bytes, revision: int) -> None:
        if key.startswith(self._entries_prefix):
            self._index.delete_entry(self._keys.parse_entry(key), revision)
        elif key.startswith(self._engines_prefix):
            self._index.delete_engine(unquote(key[len(self._engines_prefix) :].decode()), revision)
