"""The gateway's own copy of the registry's entries, fed by WatchEntries: keyed lookups without a round trip.

A turn cannot start its prefill before it knows what to pull, so the registry lookup's round trip sat on
every turn's critical path. The copy answers it in microseconds. Answering from a copy that lags the
registry by milliseconds is safe (ADR 0008):

- the registry answers from its own watch-fed index, so it lags the store too; the copy adds one hop;
- a hit is still verified: here the prompt's hash chain against the entry's, on P the prefix digest
  against P's own prompt (ADR 0007), so lag can cost a recompute, never a wrong answer;
- an entry whose lease ended a moment ago still has its blocks: the connector frees them only
  ``kvbridge_free_grace_s`` after the lease ends (stock vLLM frees on its own schedule, leases or not);
- the copy answers only hits, only while in sync (snapshot loaded, a message within ``stale_after_s``:
  the registry's watch sends a progress heartbeat only once its store answered, so a frozen store or
  registry stops the messages and the copy stops answering within that bound);
  every other case, and any hit the router then declines, goes to the registry as before;
- one miss it does answer: a conversation with no entry at all (``absent``), while in sync and complete
  (no entry left out for lack of room since the snapshot). A new conversation's first turn then skips
  tokenizing, hashing and the registry round trip (ADR 0008's addendum); an entry written within the
  copy's lag costs one turn's reuse, as it would a registry that answered a moment earlier;
- a hit names an entry of the engine's current incarnation only (``entrylookup.unusable``).

Freshness is the age of the copy's data, not of its last message (issue 30, item 8): the registry stamps each
message with when it had that state from its store (``WatchEntriesResponse.as_of``, on the registry's clock), and
the copy's lag is the larger of ``now - as_of`` on this host's clock and the time since the last message arrived.
A message that waited in a buffer (a starved event loop, a slow link) therefore no longer counts as fresh. Clock
skew errs one way only: a registry clock behind this host's makes the copy look staler (more lookups go to the
registry), one ahead is bounded by the arrival time. Safety does not depend on it either way (every hit is
verified, and blocks outlive their lease by the free grace).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.entrylookup import answer_hit, record_of, unusable
from kvbridge_services.common.hashrecord import HashRecord

from .control import ControlPlane, ControlPlaneError, KeyedLookup

log = logging.getLogger(__name__)

EntryId = tuple[str, str, str]  # (tenant, model, conversation key)
EngineRecords = Callable[[str], "types_pb2.Engine | None"]

_PUT = registry_pb2.EntryEvent.TYPE_PUT
_DELETE = registry_pb2.EntryEvent.TYPE_DELETE
_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
_MAX_WAITERS = 10_000


@dataclass(frozen=True, slots=True)
class MirroredEntry:
    entry: registry_pb2.Entry
    record: HashRecord
    revision: int  # the store's mod_revision of this version


class EntryMirror:
    """Entries by (tenant, model, conversation key), at most ``max_entries`` (the rest stay registry-only)."""

    def __init__(
        self,
        *,
        max_entries: int,
        stale_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_entries = max_entries
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: dict[EntryId, MirroredEntry] = {}
        self._loading = True  # until the snapshot's last page
        self._last_message: float | None = None
        self._data_as_of: float | None = None  # wall time the registry had the newest state (its as_of)
        self.revision = 0  # the store revision the copy is up to (for status and tests)
        self.skipped = 0  # entries not kept: the copy was full, or the entry was unusable
        self._left_out = False  # an entry was not kept for lack of room since the snapshot: absence proves nothing
        # Lookups waiting for a conversation's entry to reach an epoch (freshness.py), woken by _put.
        self._waiters: dict[EntryId, list[tuple[int, asyncio.Future[None]]]] = {}
        self._waiting = 0

    def __len__(self) -> int:
        return len(self._entries)

    def reset(self) -> None:
        """Forget everything: the next stream starts with a snapshot."""
        self._entries.clear()
        self._left_out = False
        self._loading = True
        self._last_message = None
        self._data_as_of = None
        self.revision = 0

    def lag_s(self) -> float | None:
        """How old the copy's data is: the age of the newest state the registry sent (its ``as_of``) or, if
        larger, the time since its last message (an event or a progress heartbeat, which the registry sends only
        once its store answered); None before the first message."""
        last = self._last_message
        if last is None:
            return None
        arrived = self._clock() - last
        data = self._wall_clock() - self._data_as_of if self._data_as_of is not None else 0.0
        return max(0.0, arrived, data)

    def in_sync(self) -> bool:
        """The snapshot is loaded and the copy lags by at most ``stale_after_s``: only then it answers hits."""
        lag = self.lag_s()
        return not self._loading and lag is not None and lag <= self._stale_after_s

    def apply(self, message: registry_pb2.WatchEntriesResponse) -> None:
        """One WatchEntries message: snapshot pages, events, or a progress heartbeat."""
        for event in message.events:
            key = event.entry.key
            eid = (key.tenant, key.model, key.conversation_key)
            if event.type == _PUT:
                self._put(eid, event.entry, event.revision)
            elif event.type == _DELETE:
                old = self._entries.get(eid)
                if old is not None and old.revision < event.revision:
                    del self._entries[eid]
        if message.snapshot_complete:
            self._loading = False
        self.revision = max(self.revision, message.revision)
        self._last_message = self._clock()
        if message.HasField("as_of"):
            as_of = message.as_of.ToNanoseconds() / 1e9
            self._data_as_of = as_of if self._data_as_of is None else max(self._data_as_of, as_of)

    def _put(self, eid: EntryId, entry: registry_pb2.Entry, revision: int) -> None:
        old = self._entries.get(eid)
        if old is not None and old.revision >= revision:
            return  # a snapshot page read later already holds a newer version
        if entry.block_size == 0 or entry.token_count < entry.block_size or not entry.final_block_hash:
            self.skipped += 1
            return
        if old is None and len(self._entries) >= self._max_entries:
            self.skipped += 1
            self._left_out = True
            return
        # A copy of its own: a sub-message would keep the whole received message (a 500-entry page) alive.
        own = registry_pb2.Entry()
        own.CopyFrom(entry)
        self._entries[eid] = MirroredEntry(own, record_of(own), revision)
        waiting = self._waiters.get(eid)
        if waiting:
            for min_epoch, future in waiting:
                if own.epoch >= min_epoch and not future.done():
                    future.set_result(None)

    def absent(self, eid: EntryId) -> bool:
        """True when the registry has no entry under ``eid`` as far as an in-sync, complete copy can tell (an
        entry whose shape could never be a hit counts as none); False when it may have one (ask it)."""
        return self.in_sync() and not self._left_out and eid not in self._entries

    def epoch_of(self, tenant: str, model: str, conversation_key: str) -> int | None:
        """The epoch of the conversation's entry in the copy (None: no entry here)."""
        item = self._entries.get((tenant, model, conversation_key))
        return None if item is None else int(item.entry.epoch)

    async def wait_for_epoch(self, eid: EntryId, min_epoch: int, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s``) until the copy holds the conversation's entry at ``min_epoch`` or newer;
        whether it does. Bounded: past _MAX_WAITERS waiting lookups, a new one does not wait."""
        item = self._entries.get(eid)
        if item is not None and item.entry.epoch >= min_epoch:
            return True
        if timeout_s <= 0 or self._waiting >= _MAX_WAITERS:
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(eid, [])
        waiting.append((min_epoch, future))
        self._waiting += 1
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiting -= 1
            waiting.remove((min_epoch, future))
            if not waiting:
                self._waiters.pop(eid, None)

    def lookup(self, query: KeyedLookup, *, engine_record: EngineRecords) -> registry_pb2.LookupEntryResponse | None:
        """The registry's answer for a keyed lookup when it is a HIT the copy can vouch for; else None (ask
        the registry: not in sync, no entry here, expired, engine unknown, mismatch, below threshold)."""
        if not query.conversation_key or not self.in_sync():
            return None
        item = self._entries.get((query.tenant, query.model, query.conversation_key))
        if item is None:
            return None
        entry = item.entry
        engine = engine_record(entry.engine_id)
        if engine is None or unusable(entry, query.block_size, self._wall_clock(), engine) is not None:
            return None
        blocks = item.record.verified_blocks(query.block_hashes)
        response = registry_pb2.LookupEntryResponse(prompt_block_tokens=len(query.block_hashes) * query.block_size)
        if blocks == 0 or not answer_hit(response, entry, engine, blocks, query.min_tokens):
            return None
        return response


async def follow_registry(
    control: ControlPlane, mirror: EntryMirror, *, progress_interval_s: float, stream_lifetime_s: float
) -> None:
    """Keeps ``mirror`` up to date until cancelled. Every stream, a fresh one after its lifetime deadline or
    after a failure, starts with a snapshot: resuming at a revision could silently skip changes if the
    registry's store restarted with its revisions reset (the in-memory dev store)."""
    failures = 0
    while True:
        mirror.reset()
        try:
            async for message in control.watch_entries(
                progress_interval_s=progress_interval_s, lifetime_s=stream_lifetime_s
            ):
                mirror.apply(message)
                failures = 0
        except ControlPlaneError as exc:
            mirror.reset()
            if exc.code in ("PERMISSION_DENIED", "UNAUTHENTICATED", "UNIMPLEMENTED"):
                log.error(
                    "entry mirror off (lookups go to the registry): the registry refuses this gateway's watch: %s", exc
                )
                return
            if exc.code != "DEADLINE_EXCEEDED":  # the stream's own lifetime: reopen at once
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("entry mirror: watch broken (retry in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)
