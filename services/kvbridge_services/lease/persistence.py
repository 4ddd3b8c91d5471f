"""What the leader writes to the store: lease records at grant, deadline
checkpoints, and the atomic cleanup when a lease ends.

Every write is fenced: its transaction also compares the leader key's store
lease with ours, so a deposed leader that has not noticed yet cannot write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.errors import Reason, Unavailable
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import (
    Compare,
    CompareTarget,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    Store,
    StoreUnavailable,
)

from .codec import from_proto, to_proto
from .table import NODE, Ended, LeaseRecord

log = logging.getLogger(__name__)

Fence = Callable[[], Sequence[Compare]]
_CONFLICT_RETRIES = 5
_LOAD_PAGE = 2000  # records per range read at takeover (~0.5 MB)
_MIN_ATTEMPT_S = 0.05  # no retry with less time than this left
_RETRY_PAUSE_S = 0.02


class NotLeaderAnymore(Unavailable):
    def __init__(self) -> None:
        super().__init__(Reason.NOT_LEADER, "this replica lost the lease-manager leadership; retry")


@dataclass(slots=True)
class StoreCounters:
    """Store traffic, for metrics and the benchmark."""

    txns: int = 0
    puts: int = 0
    deletes: int = 0
    gets: int = 0


class LeasePersistence:
    def __init__(
        self,
        store: Store,
        keys: KeyLayout,
        fence: Fence,
        *,
        timeout_s: float,
        batch_ops: int,
        attempt_s: float | None = None,
    ) -> None:
        self._store = store
        self._keys = keys
        self._fence = fence
        self._timeout = timeout_s
        self._attempt = min(attempt_s or timeout_s, timeout_s)
        self._batch_ops = batch_ops
        self.counters = StoreCounters()
        # Grants are group-committed: one flusher writes everything queued meanwhile in one txn.
        self._grant_queue: list[tuple[LeaseRecord, bytes, asyncio.Future[None]]] = []
        self._grant_flusher: asyncio.Task[None] | None = None

    async def _txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> bool:
        """One of our txns, tried for at most ``attempt_s`` at a time within ``timeout_s``. Every txn here may be
        applied twice with the same effect (puts of the same bytes, deletes, fenced compares), so an attempt
        that got no answer is sent again: an etcd leader kill loses the proposals forwarded to the dead leader,
        and waiting for them would hold every write for the whole timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while True:
            remaining = deadline - loop.time()
            try:
                result = await self._store.txn(compares, success, failure, timeout=min(self._attempt, remaining))
                break
            except (StoreUnavailable, TimeoutError):
                if deadline - loop.time() < _MIN_ATTEMPT_S:
                    raise
                await asyncio.sleep(_RETRY_PAUSE_S)
        self.counters.txns += 1
        for op in success if result.succeeded else failure:
            if isinstance(op, Put):
                self.counters.puts += 1
            elif isinstance(op, Delete):
                self.counters.deletes += 1
            else:
                self.counters.gets += 1
        return bool(result.succeeded)

    def _put(self, record: LeaseRecord) -> Put:
        return Put(self._keys.lease(record.lease_id), to_proto(record).SerializeToString())

    # --- grants ---

    def encode(self, record: LeaseRecord) -> bytes:
        """The bytes a grant writes (kept by the caller: ``take_back`` deletes exactly these)."""
        return to_proto(record).SerializeToString()

    async def save_granted(self, record: LeaseRecord, value: bytes) -> None:
        """Durably write a new lease (``value``: its ``encode``) before it is acknowledged.

        Raises NotLeaderAnymore when the fence failed (nothing written); any other error (a timeout, the
        store unreachable) leaves the outcome unknown: the write may still be applied."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._grant_queue.append((record, value, done))
        if self._grant_flusher is None or self._grant_flusher.done():
            self._grant_flusher = asyncio.create_task(self._flush_grants())
        await done

    async def _flush_grants(self) -> None:
        while self._grant_queue:
            batch = self._grant_queue[: self._batch_ops]
            del self._grant_queue[: len(batch)]
            puts = [Put(self._keys.lease(r.lease_id), value) for r, value, _ in batch]
            try:
                ok = await self._txn(self._fence(), puts)
                error: BaseException | None = None if ok else NotLeaderAnymore()
            except Exception as exc:  # noqa: BLE001 - handed to every waiter
                error = exc
            for _, _, done in batch:
                if done.done():
                    continue
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

    async def take_back(self, record: LeaseRecord, value: bytes) -> bool:
        """Delete a grant that was never acknowledged, if the store holds exactly what it wrote; True if it did
        (False: the write never landed).

        Not fenced: deleting our own unacknowledged write is right whoever leads now (it may be done
        after a step-down); the value compare leaves anything else under the key alone."""
        key = self._keys.lease(record.lease_id)
        return await self._txn([Compare(key, CompareTarget.VALUE, "==", value)], [Delete(key)])

    # --- checkpoints ---

    async def checkpoint(self, records: Sequence[LeaseRecord], still_live: Callable[[int], bool]) -> None:
        """Write the current deadlines of ``records``. Each put is guarded by "the key still exists",
        so a checkpoint racing with an end cannot resurrect a deleted lease."""
        step = max(1, self._batch_ops - 1)
        for start in range(0, len(records), step):
            await asyncio.sleep(0)  # a big checkpoint must not hold up expiries and renewals
            batch = [r for r in records[start : start + step] if still_live(r.lease_id)]
            for _ in range(_CONFLICT_RETRIES):
                if not batch:
                    break
                exists = [Compare(self._keys.lease(r.lease_id), CompareTarget.VERSION, ">", 0) for r in batch]
                written = [r.deadline for r in batch]
                if await self._txn([*self._fence(), *exists], [self._put(r) for r in batch]):
                    for record, deadline in zip(batch, written, strict=True):
                        record.persisted_deadline = deadline
                    break
                await self._check_fence()
                batch = [r for r in batch if still_live(r.lease_id)]

    async def _check_fence(self) -> None:
        fence = self._fence()
        if fence and not await self._txn(fence, []):
            raise NotLeaderAnymore()

    # --- ends ---

    async def delete_ended(self, ended: Sequence[Ended]) -> None:
        """Delete the lease records and, atomically with them, the registry entry (ENTRY lease) or
        engine record (NODE lease) that still points at the lease."""
        step = max(1, (self._batch_ops - 1) // 2)
        for start in range(0, len(ended), step):
            await self._delete_batch([e.record for e in ended[start : start + step]])

    def _owned_key(self, record: LeaseRecord) -> bytes | None:
        if record.kind == NODE:
            key: bytes = self._keys.engine(record.engine_id)
            return key if record.engine_id else None
        if record.conversation_key:
            entry_key: bytes = self._keys.entry(record.tenant, record.model, record.conversation_key)
            return entry_key
        return None

    @staticmethod
    def _points_at(record: LeaseRecord, kv: KeyValue) -> bool:
        try:
            if record.kind == NODE:
                return types_pb2.Engine.FromString(kv.value).node_lease_id == record.lease_id
            return registry_pb2.Entry.FromString(kv.value).lease_id == record.lease_id
        except Exception:  # noqa: BLE001 - a record we cannot parse is not ours to delete
            return False

    async def _delete_batch(self, records: list[LeaseRecord]) -> None:
        owned = [(r, self._owned_key(r)) for r in records]
        lookups = [key for _, key in owned if key is not None]
        for _ in range(_CONFLICT_RETRIES):
            kvs: dict[bytes, KeyValue] = {}
            if lookups:
                result = await self._store.txn([], [Get(k) for k in lookups], timeout=self._timeout)
                self.counters.txns += 1
                self.counters.gets += len(lookups)
                kvs = {kv.key: kv for kv in result.gets if kv is not None}
            compares = list(self._fence())
            deletes: list[Op] = [Delete(self._keys.lease(r.lease_id)) for r in records]
            for record, key in owned:
                kv = kvs.get(key) if key is not None else None
                if kv is not None and self._points_at(record, kv):
                    compares.append(Compare.mod_revision_is(kv.key, kv.mod_revision))
                    deletes.append(Delete(kv.key))
            if await self._txn(compares, deletes):
                return
            await self._check_fence()  # else an entry/engine record changed under us: read again
        log.warning("lease cleanup kept conflicting; deleting %d lease records without their entries", len(records))
        await self._txn(self._fence(), [Delete(self._keys.lease(r.lease_id)) for r in records])

    # --- takeover ---

    async def load(self) -> list[LeaseRecord]:
        """Every persisted lease, in id order."""
        records: list[LeaseRecord] = []
        prefix = self._keys.leases_prefix()
        after: bytes | None = None
        while True:
            page, _ = await self._store.range_prefix(prefix, start_after=after, limit=_LOAD_PAGE, timeout=self._timeout)
            for kv in page:
                try:
                    records.append(from_proto(lease_pb2.Lease.FromString(kv.value)))
                except Exception:  # noqa: BLE001 - skip, do not crash-loop on one bad record
                    log.error("unreadable lease record at %r; ignored", kv.key)
            if len(page) < _LOAD_PAGE:
                return records
            after = page[-1].key
