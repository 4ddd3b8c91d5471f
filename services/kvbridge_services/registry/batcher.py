"""Group commit: concurrent registrations share one read txn and one write txn (docs/adr/0005).

A registration is a read (idempotency record, entry, lease, engine) followed by a
compare-and-swap write. On etcd each txn costs a round trip and a raft fsync, so
the batcher collects the registrations arriving within a short window and runs
them as a round: one txn of Gets for every key they read, a decision per
registration, then one txn holding every registration's compares and puts.
If that combined txn fails (some compare no longer holds) or raises, each
registration is committed on its own, so one conflicting request cannot fail
the others. Registrations sharing an entry key or a request id never share a
round, nor overlap in-flight rounds: they run one after the other, in arrival
order, exactly as the unbatched path would. No caller is answered before the
txn holding its write has succeeded.

The batcher knows nothing of registry records: a ``BatchHandler`` decides per
registration and commits one alone when the combined txn fails.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvbridge.errors import Reason, Unavailable
from kvbridge_services.common.store.base import Compare, Get, KeyValue, LeaseNotFound, Put, Store

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class PlannedWrite(Generic[R]):
    """A registration's CAS write; ``on_commit(revision)`` applies side effects and returns the answer."""

    compares: tuple[Compare, ...]
    puts: tuple[Put, ...]
    on_commit: Callable[[int], R]


@dataclass(eq=False)
class BatchJob(Generic[R]):
    """One queued registration. ``exclusive_keys`` never share a round (entry key, request-id key)."""

    exclusive_keys: tuple[bytes, ...]
    read_keys: tuple[bytes, ...]
    size_hint: int
    future: asyncio.Future[R] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    payload: object = None


class BatchHandler(Protocol[R]):
    async def decide(self, job: BatchJob[R], reads: Mapping[bytes, KeyValue | None]) -> R | PlannedWrite[R]:
        """The answer (no write needed), a write to commit, or raise the RPC error."""
        ...

    async def commit_alone(self, job: BatchJob[R], plan: PlannedWrite[R]) -> R:
        """Commit one registration by itself (re-reading and deciding again if its compares fail)."""
        ...


@dataclass(frozen=True, slots=True)
class BatchLimits:
    window_s: float
    max_batch: int
    # etcd's --max-txn-ops (default 128) caps compares, success ops and failure ops of one txn, each.
    max_txn_ops: int
    # Stay under etcd's --max-request-bytes (default 1.5 MiB).
    max_txn_bytes: int
    max_inflight: int


class RegistrationBatcher(Generic[R]):
    def __init__(self, store: Store, handler: BatchHandler[R], limits: BatchLimits, *, timeout_s: float) -> None:
        self._store = store
        self._handler = handler
        self._limits = limits
        self._timeout = timeout_s
        self._queue: collections.deque[BatchJob[R]] = collections.deque()
        self._busy: set[bytes] = set()  # exclusive keys of jobs in in-flight rounds
        self._inflight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        # Counters for tests and benchmarks: combined txns that committed, and fallbacks.
        self.combined_commits = 0
        self.fallbacks = 0

    async def submit(self, job: BatchJob[R]) -> R:
        if self._closed:
            raise Unavailable(Reason.OVERLOADED, "registry is shutting down")
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="registry-group-commit")
        self._queue.append(job)
        self._wake.set()
        return await job.future

    async def close(self) -> None:
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(Unavailable(Reason.OVERLOADED, "registry is shutting down"))

    # ------------------------------------------------------------------ windowing

    async def _run(self) -> None:
        while True:
            await self._wait_for_work()
            round_ = self._take_round()
            if not round_:
                # Everything queued waits on a key of an in-flight round: sleep until one finishes.
                self._wake.clear()
                await self._wake.wait()
                continue
            for job in round_:
                self._busy.update(job.exclusive_keys)
            task = asyncio.get_running_loop().create_task(self._run_round(round_))
            self._inflight.add(task)
            task.add_done_callback(self._round_done)

    async def _wait_for_work(self) -> None:
        while not self._queue or len(self._inflight) >= self._limits.max_inflight:
            self._wake.clear()
            await self._wake.wait()
        # Group commit window: from the first queued job until the window ends or a batch is full.
        deadline = time.monotonic() + self._limits.window_s
        while len(self._queue) < self._limits.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    def _take_round(self) -> list[BatchJob[R]]:
        """Jobs in arrival order whose exclusive keys are free; the others stay queued, in order."""
        taken: list[BatchJob[R]] = []
        kept: list[BatchJob[R]] = []
        claimed = set(self._busy)
        while self._queue and len(taken) < self._limits.max_batch:
            job = self._queue.popleft()
            if job.future.done():  # caller gone before we started: nothing to do
                continue
            if claimed.intersection(job.exclusive_keys):
                kept.append(job)
            else:
                claimed.update(job.exclusive_keys)
                taken.append(job)
        self._queue.extendleft(reversed(kept))
        return taken

    def _round_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._wake.set()

    # ------------------------------------------------------------------ one round

    async def _run_round(self, jobs: list[BatchJob[R]]) -> None:
        try:
            await asyncio.gather(*(self._run_chunk(chunk) for chunk in self._chunks(jobs)))
        finally:
            for job in jobs:
                self._busy.difference_update(job.exclusive_keys)
                if not job.future.done():  # defensive: never leave a caller hanging
                    job.future.set_exception(Unavailable(Reason.OVERLOADED, "registration was not completed"))

    def _chunks(self, jobs: Sequence[BatchJob[R]]) -> list[list[BatchJob[R]]]:
        """Split so each chunk's read txn and write txn stay within the op and byte limits.

        Per registration: one Get and one Compare per read key (shared lease/engine keys
        counted once), two Puts; a chunk always holds at least one job.
        """
        chunks: list[list[BatchJob[R]]] = []
        current: list[BatchJob[R]] = []
        keys: set[bytes] = set()
        size = 0
        for job in jobs:
            new_keys = keys.union(job.read_keys)
            too_big = (
                len(new_keys) > self._limits.max_txn_ops
                or 2 * (len(current) + 1) > self._limits.max_txn_ops
                or size + job.size_hint > self._limits.max_txn_bytes
            )
            if current and too_big:
                chunks.append(current)
                current, new_keys, size = [], set(job.read_keys), 0
            current.append(job)
            keys = new_keys
            size += job.size_hint
        if current:
            chunks.append(current)
        return chunks

    async def _run_chunk(self, jobs: list[BatchJob[R]]) -> None:
        keys = list(dict.fromkeys(k for job in jobs for k in job.read_keys))
        try:
            snap = await self._store.txn([], [Get(k) for k in keys], timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - every waiting caller gets the store's error
            for job in jobs:
                _fail(job, exc)
            return
        reads = dict(zip(keys, snap.gets, strict=True))
        planned: list[tuple[BatchJob[R], PlannedWrite[R]]] = []
        for job in jobs:
            try:
                outcome = await self._handler.decide(job, reads)
            except Exception as exc:  # noqa: BLE001 - the RPC error for this caller only
                _fail(job, exc)
                continue
            if isinstance(outcome, PlannedWrite):
                planned.append((job, outcome))
            elif not job.future.done():
                job.future.set_result(outcome)
        if not planned:
            return
        if len(planned) > 1 and await self._commit_combined(planned):
            return
        await asyncio.gather(*(self._commit_alone(job, plan) for job, plan in planned))

    async def _commit_combined(self, planned: list[tuple[BatchJob[R], PlannedWrite[R]]]) -> bool:
        compares = list(dict.fromkeys(c for _, plan in planned for c in plan.compares))
        puts = [p for _, plan in planned for p in plan.puts]
        if len(compares) > self._limits.max_txn_ops or len(puts) > self._limits.max_txn_ops:
            return False
        try:
            result = await self._store.txn(compares, puts, timeout=self._timeout)
        except LeaseNotFound:  # some registration's lease just ended: find out which, one by one
            result = None
        except Exception as exc:  # noqa: BLE001 - e.g. StoreUnavailable: the outcome is unknown to all
            for job, _ in planned:
                _fail(job, exc)
            return True
        if result is None or not result.succeeded:
            self.fallbacks += 1
            return False
        self.combined_commits += 1
        for job, plan in planned:
            try:
                answer = plan.on_commit(result.revision)
            except Exception as exc:  # committed; a failing side effect must not leave the caller hanging
                log.exception("post-commit step failed")
                _fail(job, exc)
                continue
            if not job.future.done():
                job.future.set_result(answer)
        return True

    async def _commit_alone(self, job: BatchJob[R], plan: PlannedWrite[R]) -> None:
        try:
            answer = await self._handler.commit_alone(job, plan)
        except Exception as exc:  # noqa: BLE001 - the RPC error for this caller only
            _fail(job, exc)
            return
        if not job.future.done():
            job.future.set_result(answer)


def _fail(job: BatchJob[R], exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
