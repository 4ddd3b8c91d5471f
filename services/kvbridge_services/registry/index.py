"""The in-memory index every lookup is served from, fed by the store (list + watch).

It mirrors the store's entries and engines of this deployment, so its size is
bounded by the registry's caps on what it writes (per-tenant entry cap, engine
cap, ``max_index_entries``); records arriving past the hard cap are dropped
from memory (logged) rather than growing it.

It answers only while fresh: the feeder calls ``heard`` each time the store
answered its watch (an event or a progress notification); past ``max_lag_s``
without one, lookups get INDEX_STALE instead of a hit that may name a deleted
entry (docs/adr/0010).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetools import FIFOCache

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.entrylookup import record_of
from kvbridge_services.common.hashrecord import HashRecord

log = logging.getLogger(__name__)

EntryId = tuple[str, str, str]  # (tenant, model, conversation_key)
MAX_TOMBSTONES = 100_000  # recent deletions remembered against late watch events


@dataclass(slots=True)
class IndexedEntry:
    id: EntryId
    entry: registry_pb2.Entry
    record: HashRecord
    mod_revision: int
    last_used: float = field(default_factory=time.monotonic)


class RegistryIndex:
    def __init__(
        self,
        max_entries: int = 1_000_000,
        max_engines: int = 10_000,
        content_stride: int = 16,
        *,
        max_lag_s: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_entries = max_entries
        self.max_lag_s = max_lag_s
        self._clock = clock
        # When the store last answered the feeder (None: never, e.g. before the first list).
        self._heard_at: float | None = None
        # Content-addressed lookups index only hashes at multiples of this many blocks (plus each
        # entry's final block), bounding memory; verification then uses the entry's finer record.
        self.content_stride = content_stride
        self._max_engines = max_engines
        self.entries: dict[EntryId, IndexedEntry] = {}
        # Per tenant, entries in least-recently-used order (first = oldest idle).
        self._by_tenant: dict[str, OrderedDict[EntryId, None]] = {}
        # Block hash -> the entry (or entries) holding it. Chains are seeded by tenant and model, so
        # honest hashes never collide across tenants; callers still filter candidates by tenant.
        self._content: dict[bytes, EntryId | set[EntryId]] = {}
        self.engines: dict[str, types_pb2.Engine] = {}
        # Engine id -> its entries (any incarnation), for dropping a previous incarnation's entries.
        self._by_engine: dict[str, set[EntryId]] = {}
        # Engines that may hold entries of another incarnation than their current one (the engine sweep
        # visits only these, not every entry).
        self.suspect_engines: set[str] = set()
        self._engine_revs: dict[str, int] = {}
        # Recent deletions (id -> revision), so a late event of an older put does not resurrect an
        # entry deleted by this replica ahead of its watch. FIFO-capped (a re-deletion moves to the end).
        self._tombstones: FIFOCache[EntryId, int] = FIFOCache(maxsize=MAX_TOMBSTONES)

    # --- freshness ---

    def heard(self) -> None:
        """The store answered the feeder just now (a watch event, a progress notification or a list)."""
        self._heard_at = self._clock()

    def lag_s(self) -> float:
        """Seconds since the store last answered the feeder (infinite before the first time)."""
        heard = self._heard_at
        return float("inf") if heard is None else max(0.0, self._clock() - heard)

    def fresh(self) -> bool:
        """The index may answer hits: it heard from the store within ``max_lag_s``."""
        heard = self._heard_at
        return heard is not None and self._clock() - heard <= self.max_lag_s

    # --- mutation (from the watch, or right after our own successful write) ---

    def put_entry(self, entry: registry_pb2.Entry, mod_revision: int) -> None:
        eid: EntryId = (entry.key.tenant, entry.key.model, entry.key.conversation_key)
        if self._tombstones.get(eid, 0) >= mod_revision:
            return
        old = self.entries.get(eid)
        if old is not None:
            if old.mod_revision >= mod_revision:
                return
            self._unlink(old)
        elif len(self.entries) >= self._max_entries:
            log.error("registry index full (%d entries); not indexing %s", self._max_entries, eid)
            return
        item = IndexedEntry(eid, entry, record_of(entry), mod_revision)
        self.entries[eid] = item
        self._by_tenant.setdefault(eid[0], OrderedDict())[eid] = None
        self._by_engine.setdefault(entry.engine_id, set()).add(eid)
        engine = self.engines.get(entry.engine_id)
        if engine is not None and engine.node_lease_id != entry.engine_incarnation:
            self.suspect_engines.add(entry.engine_id)
        for h in self._content_hashes(item):
            holders = self._content.get(h)
            if holders is None:
                self._content[h] = eid
            elif isinstance(holders, set):
                holders.add(eid)
            elif holders != eid:
                self._content[h] = {holders, eid}

    def delete_entry(self, eid: EntryId, revision: int) -> None:
        old = self.entries.get(eid)
        if old is not None and old.mod_revision < revision:
            self._unlink(old)
            del self.entries[eid]
        if self._tombstones.get(eid, 0) < revision:
            self._tombstones[eid] = revision

    def _unlink(self, item: IndexedEntry) -> None:
        tenant = item.id[0]
        if item.id in self.entries and self.entries[item.id] is item:
            order = self._by_tenant.get(tenant)
            if order is not None:
                order.pop(item.id, None)
                if not order:
                    del self._by_tenant[tenant]
            of_engine = self._by_engine.get(item.entry.engine_id)
            if of_engine is not None:
                of_engine.discard(item.id)
                if not of_engine:
                    del self._by_engine[item.entry.engine_id]
        for h in self._content_hashes(item):
            holders = self._content.get(h)
            if holders == item.id:
                del self._content[h]
            elif isinstance(holders, set):
                holders.discard(item.id)
                if len(holders) == 1:
                    self._content[h] = next(iter(holders))

    def _content_hashes(self, item: IndexedEntry) -> list[bytes]:
        last = item.record.blocks - 1
        return [h for pos, h in item.record.positions() if (pos + 1) % self.content_stride == 0 or pos == last]

    def put_engine(self, engine: types_pb2.Engine, mod_revision: int) -> None:
        if self._engine_revs.get(engine.engine_id, 0) >= mod_revision:
            return
        if engine.engine_id not in self.engines and len(self.engines) >= self._max_engines:
            log.error("registry index holds %d engines (cap); not indexing %s", self._max_engines, engine.engine_id)
            return
        old = self.engines.get(engine.engine_id)
        if old is not None and old.node_lease_id != engine.node_lease_id and engine.engine_id in self._by_engine:
            self.suspect_engines.add(engine.engine_id)
        self.engines[engine.engine_id] = engine
        self._engine_revs[engine.engine_id] = mod_revision

    def delete_engine(self, engine_id: str, revision: int) -> None:
        if self._engine_revs.get(engine_id, 0) < revision:
            self.engines.pop(engine_id, None)
            self._engine_revs.pop(engine_id, None)

    def clear(self) -> None:
        self.entries.clear()
        self._by_tenant.clear()
        self._by_engine.clear()
        self.suspect_engines.clear()
        self._content.clear()
        self.engines.clear()
        self._engine_revs.clear()
        self._tombstones.clear()

    # --- queries ---

    def touch(self, eid: EntryId) -> None:
        item = self.entries.get(eid)
        if item is not None:
            item.last_used = time.monotonic()
            self._by_tenant[eid[0]].move_to_end(eid)

    def tenant_count(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def oldest_idle(self, tenant: str, exclude: EntryId | None = None) -> IndexedEntry | None:
        for eid in self._by_tenant.get(tenant, ()):
            if eid != exclude:
                return self.entries[eid]
        return None

    def holders(self, tenant: str, model: str, block_hash: bytes, limit: int = 1 << 30) -> list[EntryId]:
        """Up to ``limit`` entries of (tenant, model) holding ``block_hash``."""
        found = self._content.get(block_hash)
        if found is None:
            return []
        if not isinstance(found, set):
            return [found] if found[0] == tenant and found[1] == model else []
        out: list[EntryId] = []
        for e in found:
            if e[0] == tenant and e[1] == model:
                out.append(e)
                if len(out) >= limit:
                    break
        return out

    def of_other_incarnations(self, engine: types_pb2.Engine) -> list[IndexedEntry]:
        """The entries of ``engine``'s id made by another incarnation than ``engine`` (a previous process)."""
        return [
            item
            for eid in self._by_engine.get(engine.engine_id, ())
            if (item := self.entries[eid]).entry.engine_incarnation != engine.node_lease_id
        ]
