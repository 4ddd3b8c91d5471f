"""MemoryStore: etcd's semantics in-process (the embedded single-node backend).

One global revision counter; every committed change bumps it once and becomes
one history entry whose events all carry that revision (a lease expiry that
deletes five keys is one revision, like etcd). Watchers read the shared,
bounded history from their own next revision, so a slow watcher costs no
memory; one that falls behind the history gets ``Compacted``, as with etcd.

With ``data_dir`` every commit is fsynced to a write-ahead log before it is
acknowledged, and the state is replayed on open (``wal``: a damaged log or
snapshot refuses to open with ``StoreDamaged``). A failed log write is
fail-stop: that commit and every later one get ``StoreUnavailable`` until the
process restarts (what reached the disk is unknown). Leases are restored with a
full TTL (etcd does the same on leader change), so a restart never expires a
lease whose holder kept renewing while the store was down.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvbridge_services.common.keys import is_soft_state

from .base import (
    DEFAULT_TIMEOUT_S,
    Compacted,
    Compare,
    CompareTarget,
    Delete,
    EventType,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    RangeQuery,
    Store,
    StoreUnavailable,
    Txn,
    TxnResult,
    WatchBatch,
    WatchEvent,
    WatchQuery,
)
from .wal import DEFAULT_MAX_LOG_BYTES, StoreDamaged, WriteAheadLog, b2s, s2b

log = logging.getLogger(__name__)

DEFAULT_HISTORY_REVISIONS = 10_000
# Events handed to a watcher per batch (a batch never splits one revision).
_WATCH_BATCH_EVENTS = 1000
_MAX_LEASE_TTL_S = 9_000_000_000  # etcd's MaxLeaseTTL

# A mutation: ("put", key, value, lease) | ("del", key) | ("grant", id, ttl) | ("revoke", id)
Mutation = tuple[Any, ...]
_T = TypeVar("_T")


@dataclass(slots=True)
class _Lease:
    ttl: int
    deadline: float  # time.monotonic()
    keys: set[bytes] = field(default_factory=set)


def compare_holds(compare: Compare, kv: KeyValue | None) -> bool:
    """etcd's compare rules: a missing key has version/create/mod/lease 0 and fails any VALUE compare."""
    if compare.target is CompareTarget.VALUE:
        if kv is None:
            return False
        actual: int | bytes = kv.value
    elif compare.target is CompareTarget.VERSION:
        actual = kv.version if kv else 0
    elif compare.target is CompareTarget.CREATE:
        actual = kv.create_revision if kv else 0
    elif compare.target is CompareTarget.MOD:
        actual = kv.mod_revision if kv else 0
    else:
        actual = kv.lease if kv else 0
    operand = compare.operand
    if isinstance(actual, bytes) != isinstance(operand, bytes):
        raise TypeError(f"compare on {compare.target.value} needs a {type(actual).__name__} operand")
    if compare.op == "==":
        return actual == operand
    if compare.op == "!=":
        return actual != operand
    if compare.op == "<":
        return actual < operand  # type: ignore[operator]
    return actual > operand  # type: ignore[operator]


class MemoryStore(Store):
    def __init__(
        self,
        *,
        data_dir: Path | None = None,
        history_revisions: int = DEFAULT_HISTORY_REVISIONS,
        max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
    ) -> None:
        if history_revisions < 1:
            raise ValueError("history_revisions must be >= 1")
        self._kvs: dict[bytes, KeyValue] = {}
        self._sorted_keys: list[bytes] = []
        self._rev = 1  # etcd starts at revision 1 with an empty keyspace
        self._history: deque[tuple[int, list[WatchEvent]]] = deque(maxlen=history_revisions)
        self._compacted_rev = 0  # watches must start at or after this revision
        self._leases: dict[int, _Lease] = {}
        self._lock = asyncio.Lock()
        self._changed: asyncio.Event | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._closed = False
        self._wal: WriteAheadLog | None = None
        self._failed: str | None = None  # why writes are refused (fail-stop after a failed log write)
        self.retired = 0  # soft-state keys retired at open (a new generation)
        if data_dir is not None:
            self._wal = WriteAheadLog(data_dir, max_log_bytes=max_log_bytes)
            try:
                self._recover()
            except BaseException:
                self._wal.close()
                raise

    # ------------------------------------------------------------------ reads

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("store is closed")
        self._ensure_expiry_task()

    async def get(self, key: bytes, *, timeout: float = DEFAULT_TIMEOUT_S) -> KeyValue | None:
        self._check_open()
        return self._kvs.get(key)

    async def read_range(self, query: RangeQuery, *, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[KeyValue], int]:
        self._check_open()
        keys = self._keys_with_prefix(query.prefix, query.start_after)
        if query.limit:
            keys = keys[: query.limit]
        out = [self._kvs[k] for k in keys]
        if query.keys_only:
            out = [KeyValue(kv.key, b"", kv.create_revision, kv.mod_revision, kv.version, kv.lease) for kv in out]
        return out, self._rev

    def _keys_with_prefix(self, prefix: bytes, start_after: bytes | None = None) -> list[bytes]:
        lo = bisect.bisect_left(self._sorted_keys, prefix)
        if start_after is not None and start_after >= prefix:
            lo = max(lo, bisect.bisect_right(self._sorted_keys, start_after))
        out: list[bytes] = []
        for key in self._sorted_keys[lo:]:
            if not key.startswith(prefix):
                break
            out.append(key)
        return out

    async def current_revision(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        self._check_open()
        return self._rev

    async def lease_ttl(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        self._check_open()
        lease = self._leases.get(lease_id)
        if lease is None:
            return -1
        remaining = lease.deadline - time.monotonic()
        return max(0, math.ceil(remaining)) if remaining > 0 else -1

    # ----------------------------------------------------------------- writes

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        result = await self.txn((), (Put(key, value, lease),), timeout=timeout)
        return result.revision

    async def delete(self, key: bytes, *, prefix: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        def build() -> tuple[list[Mutation], int]:
            keys = self._keys_with_prefix(key) if prefix else ([key] if key in self._kvs else [])
            return [("del", k) for k in keys], len(keys)

        return await self._commit(build, timeout)

    async def apply_txn(self, txn: Txn, *, timeout: float = DEFAULT_TIMEOUT_S) -> TxnResult:
        def build() -> tuple[list[Mutation], TxnResult]:
            succeeded = all(compare_holds(c, self._kvs.get(c.key)) for c in txn.compares)
            mutations, gets = self._plan_ops(txn.success if succeeded else txn.failure)
            revision = self._rev + 1 if any(m[0] in ("put", "del") for m in mutations) else self._rev
            return mutations, TxnResult(succeeded=succeeded, revision=revision, gets=gets)

        return await self._commit(build, timeout)

    def _plan_ops(self, ops: Sequence[Op]) -> tuple[list[Mutation], list[KeyValue | None]]:
        """Mutations of a txn branch; Gets see the branch's earlier writes (as in etcd)."""
        overlay: dict[bytes, KeyValue | None] = {}
        mutations: list[Mutation] = []
        gets: list[KeyValue | None] = []
        next_rev = self._rev + 1

        def current(k: bytes) -> KeyValue | None:
            return overlay[k] if k in overlay else self._kvs.get(k)

        for op in ops:
            if isinstance(op, Put):
                if op.lease and op.lease not in self._leases:
                    raise LeaseNotFound(f"lease {op.lease:x} not found")
                prev = current(op.key)
                overlay[op.key] = KeyValue(
                    op.key,
                    op.value,
                    prev.create_revision if prev else next_rev,
                    next_rev,
                    prev.version + 1 if prev else 1,
                    op.lease,
                )
                mutations.append(("put", op.key, op.value, op.lease))
            elif isinstance(op, Delete):
                if op.prefix:
                    base = set(self._keys_with_prefix(op.key))
                    keys = sorted(k for k in base | {k for k in overlay if k.startswith(op.key)} if current(k))
                else:
                    keys = [op.key] if current(op.key) else []
                for k in keys:
                    overlay[k] = None
                    mutations.append(("del", k))
            else:
                gets.append(current(op.key))
        return mutations, gets

    async def grant_lease(self, ttl_s: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        if not 1 <= ttl_s <= _MAX_LEASE_TTL_S:
            raise ValueError(f"lease TTL must be 1..{_MAX_LEASE_TTL_S} seconds")

        def build() -> tuple[list[Mutation], int]:
            lease_id = secrets.randbits(62) or 1
            while lease_id in self._leases:
                lease_id = secrets.randbits(62) or 1
            return [("grant", lease_id, ttl_s)], lease_id

        return await self._commit(build, timeout)

    async def refresh_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        self._check_open()
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline <= time.monotonic():
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        # Not logged: a restart grants every lease a full TTL anyway.
        lease.deadline = time.monotonic() + lease.ttl
        return lease.ttl

    async def revoke_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        def build() -> tuple[list[Mutation], None]:
            return self._revoke_mutations(lease_id), None

        await self._commit(build, timeout)

    def _revoke_mutations(self, lease_id: int) -> list[Mutation]:
        lease = self._leases.get(lease_id)
        if lease is None:
            return []
        return [*(("del", k) for k in sorted(lease.keys)), ("revoke", lease_id)]

    # ------------------------------------------------------------ committing

    async def _commit(self, build: Callable[[], tuple[list[Mutation], _T]], timeout: float) -> _T:
        """Serialize: plan under the lock, make durable, apply, wake watchers.

        Once the log write starts it completes even if the caller gives up, so
        memory and disk never diverge (the caller then sees StoreUnavailable:
        outcome unknown, exactly as with etcd).
        """
        self._check_open()
        if self._failed is not None:
            raise StoreUnavailable(self._failed)
        try:
            async with asyncio.timeout(timeout):
                await self._lock.acquire()
        except TimeoutError as exc:
            raise StoreUnavailable(f"store busy for {timeout}s") from exc
        if self._failed is not None:  # failed while this caller waited for the lock
            self._lock.release()
            raise StoreUnavailable(self._failed)
        try:
            mutations, result = build()
        except BaseException:
            self._lock.release()
            raise
        task = asyncio.ensure_future(self._persist_and_apply(mutations))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TimeoutError as exc:
            raise StoreUnavailable(f"commit not durable within {timeout}s (outcome unknown)") from exc
        except OSError as exc:  # the log write failed: not acknowledged, and the store is now fail-stop
            raise StoreUnavailable(self._failed or f"log write failed: {exc}") from exc
        return result

    async def _persist_and_apply(self, mutations: list[Mutation]) -> None:
        try:
            if not mutations:
                return
            touches_kv = any(m[0] in ("put", "del") for m in mutations)
            revision = self._rev + 1 if touches_kv else self._rev
            if self._wal is not None:
                record = {"rev": revision, "m": [_encode_mutation(m) for m in mutations]}
                try:
                    await asyncio.to_thread(self._wal.append, record)
                except OSError as exc:
                    self._fail_stop("append to", exc)
                    raise
            self._apply(revision, mutations, time.monotonic())
            if self._wal is not None and self._wal.needs_snapshot():
                try:
                    await asyncio.to_thread(self._wal.write_snapshot, self._snapshot_state())
                except OSError as exc:  # this commit is durable in the log; later ones are refused
                    self._fail_stop("snapshot of", exc)
        finally:
            self._lock.release()

    def _fail_stop(self, what: str, exc: OSError) -> None:
        assert self._wal is not None
        self._failed = (
            f"embedded store: {what} {self._wal.directory} failed ({exc}); it refuses every write until the "
            f"process restarts (the log is replayed then)"
        )
        log.critical("%s", self._failed)

    def _apply(self, revision: int, mutations: list[Mutation], now: float) -> None:
        events: list[WatchEvent] = []
        for m in mutations:
            kind = m[0]
            if kind == "put":
                _, key, value, lease_id = m
                prev = self._kvs.get(key)
                if prev is not None and prev.lease and prev.lease != lease_id and prev.lease in self._leases:
                    self._leases[prev.lease].keys.discard(key)
                kv = KeyValue(
                    key,
                    value,
                    prev.create_revision if prev else revision,
                    revision,
                    prev.version + 1 if prev else 1,
                    lease_id,
                )
                if prev is None:
                    bisect.insort(self._sorted_keys, key)
                self._kvs[key] = kv
                if lease_id and lease_id in self._leases:
                    self._leases[lease_id].keys.add(key)
                events.append(WatchEvent(EventType.PUT, kv, prev))
            elif kind == "del":
                key = m[1]
                prev = self._kvs.pop(key, None)
                if prev is None:
                    continue
                del self._sorted_keys[bisect.bisect_left(self._sorted_keys, key)]
                if prev.lease and prev.lease in self._leases:
                    self._leases[prev.lease].keys.discard(key)
                events.append(WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, revision, 0), prev))
            elif kind == "grant":
                _, lease_id, ttl = m
                self._leases[lease_id] = _Lease(ttl, now + ttl)
            elif kind == "revoke":
                self._leases.pop(m[1], None)
        if events:
            self._rev = revision
            if len(self._history) == self._history.maxlen:
                self._compacted_rev = self._history[0][0] + 1
            self._history.append((revision, events))
            if self._changed is not None:
                self._changed.set()
                self._changed = None

    # ------------------------------------------------------------------ leases

    def _ensure_expiry_task(self) -> None:
        if self._expiry_task is None and not self._closed:
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_leases(), name="lease-expiry")

    async def _expire_leases(self) -> None:
        while True:
            now = time.monotonic()
            due = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
            for lease_id in due:
                with contextlib.suppress(StoreUnavailable):
                    await self._commit(self._expiry_plan(lease_id), DEFAULT_TIMEOUT_S)
            next_deadline = min((lease.deadline for lease in self._leases.values()), default=now + 1.0)
            # Poll at least every 100 ms: grants and refreshes move deadlines without waking this task.
            await asyncio.sleep(min(max(next_deadline - time.monotonic(), 0.01), 0.1))

    def _expiry_plan(self, lease_id: int) -> Callable[[], tuple[list[Mutation], None]]:
        def build() -> tuple[list[Mutation], None]:
            lease = self._leases.get(lease_id)
            if lease is None or lease.deadline > time.monotonic():
                return [], None  # revoked or refreshed meanwhile
            return self._revoke_mutations(lease_id), None

        return build

    # ------------------------------------------------------------------- watch

    async def watch(self, query: WatchQuery) -> AsyncIterator[WatchBatch]:
        self._check_open()
        prefix, progress_interval_s = query.prefix, query.progress_interval_s
        next_rev = query.start_revision or self._rev + 1
        while True:
            if self._closed:
                raise StoreUnavailable("store is closed")
            if next_rev < self._compacted_rev:
                raise Compacted(self._compacted_rev)
            events, next_rev = self._events_since(prefix, next_rev)
            if events:
                yield WatchBatch(events, next_rev - 1)
                continue
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = self._changed
            try:
                async with asyncio.timeout(progress_interval_s if progress_interval_s > 0 else None):
                    await changed.wait()
            except TimeoutError:
                yield WatchBatch([], self._rev)

    def _events_since(self, prefix: bytes, next_rev: int) -> tuple[list[WatchEvent], int]:
        """Matching events from ``next_rev`` (whole revisions, about one batch) and the next revision to read."""
        out: list[WatchEvent] = []
        if not self._history or next_rev > self._rev:
            return out, max(next_rev, self._rev + 1)
        first = self._history[0][0]
        for idx in range(max(0, next_rev - first), len(self._history)):
            revision, events = self._history[idx]
            out.extend(e for e in events if e.kv.key.startswith(prefix))
            if len(out) >= _WATCH_BATCH_EVENTS:
                return out, revision + 1
        return out, self._rev + 1

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches from older revisions get Compacted)."""
        while self._history and self._history[0][0] < revision:
            self._history.popleft()
        self._compacted_rev = max(self._compacted_rev, min(revision, self._rev))

    # -------------------------------------------------------- durability/close

    def _snapshot_state(self) -> dict[str, Any]:
        return {
            "rev": self._rev,
            "kvs": [
                [b2s(kv.key), b2s(kv.value), kv.create_revision, kv.mod_revision, kv.version, kv.lease]
                for kv in self._kvs.values()
            ],
            "leases": [[lid, lease.ttl] for lid, lease in self._leases.items()],
        }

    def _recover(self) -> None:
        assert self._wal is not None
        snapshot, records = self._wal.load()
        try:
            self._replay(snapshot, records)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # intact checksums, unexpected content
            raise StoreDamaged(
                f"embedded store in {self._wal.directory}: a record or the snapshot has unexpected content "
                f"({type(exc).__name__}: {exc}); refusing to open. Restore the directory from a backup"
            ) from None
        if self._wal.legacy_snapshot:  # migrate: rewrite it with its checksum header
            self._wal.write_snapshot(self._snapshot_state())
            log.info("embedded store: rewrote the snapshot in %s with a checksum", self._wal.directory)
        if self._wal.rollback:
            self._begin_generation(self._wal.rollback)

    def _begin_generation(self, reason: str) -> None:
        """A rolled-back store (repaired, restored, copied): retire the older generation's soft state durably,
        then record the new generation (ADR 0024). A crash in between retires again on the next open."""
        assert self._wal is not None
        doomed = [key for key in self._sorted_keys if is_soft_state(key, self._kvs[key].value)]
        if doomed:
            mutations: list[Mutation] = [("del", key) for key in doomed]
            self._wal.append({"rev": self._rev + 1, "m": [_encode_mutation(m) for m in mutations]})
            self._apply(self._rev + 1, mutations, time.monotonic())
            self._history.clear()
            self._compacted_rev = self._rev + 1
        old = self._wal.generation
        new = self._wal.begin_generation(reason)
        self.retired = len(doomed)
        log.warning(
            "embedded store %s starts a new generation %s (was %s): %s; retired %d entries, entry leases and "
            "idempotency records of the older generation (engines keep their node leases and register anew)",
            self._wal.directory,
            new,
            old or "none",
            reason,
            len(doomed),
        )

    @property
    def generation(self) -> str:
        """The embedded store's generation id ("" without a data directory)."""
        return self._wal.generation if self._wal is not None else ""

    def _replay(self, snapshot: dict[str, Any] | None, records: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        if snapshot is not None:
            self._rev = int(snapshot["rev"])
            for lid, ttl in snapshot["leases"]:
                self._leases[int(lid)] = _Lease(int(ttl), now + int(ttl))
            for key_s, value_s, create, mod, version, lease_id in snapshot["kvs"]:
                kv = KeyValue(s2b(key_s), s2b(value_s), create, mod, version, lease_id)
                self._kvs[kv.key] = kv
                if lease_id in self._leases:
                    self._leases[lease_id].keys.add(kv.key)
            self._sorted_keys = sorted(self._kvs)
        for record in records:
            self._apply(int(record["rev"]), [_decode_mutation(m) for m in record["m"]], now)
        # History from before the restart is gone: watches must start after the recovered revision.
        self._history.clear()
        self._compacted_rev = self._rev + 1 if self._rev > 1 else 0

    async def close(self) -> None:
        if self._closed:
            return
        async with self._lock:
            self._closed = True
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        if self._changed is not None:
            self._changed.set()
        if self._wal is not None:
            self._wal.close()


def _encode_mutation(m: Mutation) -> list[Any]:
    if m[0] == "put":
        return ["put", b2s(m[1]), b2s(m[2]), m[3]]
    if m[0] == "del":
        return ["del", b2s(m[1])]
    return list(m)


def _decode_mutation(m: list[Any]) -> Mutation:
    if m[0] == "put":
        return ("put", s2b(m[1]), s2b(m[2]), int(m[3]))
    if m[0] == "del":
        return ("del", s2b(m[1]))
    return tuple(m)
