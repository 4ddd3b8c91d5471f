"""The leader's lease logic: table + persistence + watch fan-out + background loops.

Independent of gRPC (the servicer translates requests) and of election (the
app calls ``take_over`` / ``step_down``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from cachetools import FIFOCache
from prometheus_client import CollectorRegistry

from kvbridge.backoff import Backoff, retry
from kvbridge.errors import AlreadyExists, DeadlineExceeded, NotFound, Reason, Unavailable
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.base import StoreNoSpace

from .metrics import LeaseMetrics, LeaseState
from .persistence import LeasePersistence, NotLeaderAnymore
from .policy import LeasePolicy
from .table import Clock, Ended, LeaseRecord, LeaseTable, TableLimits, reason_name
from .watchers import ACTIVE, ENDED, RENEWED, WatchHub

log = logging.getLogger(__name__)
R = types_pb2.RevokeReason
_END_CONCURRENCY = 4
_END_RETRY_S = 0.5
TimeLeft = Callable[[], float | None]  # seconds left of a caller's deadline (None: none)


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[int], error: BaseException) -> None:
    """Fail ``future`` unless something already completed it (one place decides each grant's outcome)."""
    if not future.done():
        future.set_exception(error)


@dataclass(frozen=True, slots=True)
class GrantSpec:
    kind: int
    tenant: str
    engine_id: str
    model: str
    conversation_key: str
    retained_tokens: int
    ttl_s: float

    @staticmethod
    def of(record: LeaseRecord) -> GrantSpec:
        """The request a persisted lease was granted for (to rebuild idempotency records at takeover)."""
        return GrantSpec(
            record.kind,
            record.tenant,
            record.engine_id,
            record.model,
            record.conversation_key,
            record.retained_tokens,
            record.ttl_s,
        )


@dataclass(eq=False, slots=True)
class _Pending:
    """A grant until its outcome is known: the lease id, or why not. ``waiters``: the time left to each RPC
    awaiting it now (the first caller and request_id replays); a grant whose write lands when none of them
    has ``_ACK_MARGIN_S`` left is taken back."""

    spec: GrantSpec
    future: asyncio.Future[int]
    waiters: list[TimeLeft] = field(default_factory=list)

    def awaited(self) -> bool:
        return any((left := t()) is None or left > _ACK_MARGIN_S for t in self.waiters)


_TAKE_BACK_ATTEMPTS = 3
# A response sent with less of its deadline left would most likely reach its caller too late (the caller's
# deadline runs ahead of the server's by the network and queueing delay): such a grant is not acknowledged.
_ACK_MARGIN_S = 0.1


class LeaseManager:
    def __init__(
        self,
        policy: LeasePolicy,
        persistence: LeasePersistence,
        *,
        leader_hint: Callable[[], str | None] = lambda: None,
        on_fenced: Callable[[], None] = lambda: None,
        clock: Clock = time.time,
        metrics: LeaseMetrics | None = None,
    ) -> None:
        self.policy = policy
        self.persistence = persistence
        self._leader_hint = leader_hint
        self._on_fenced = on_fenced
        self.table = LeaseTable(
            TableLimits(
                max_leases=policy.max_leases,
                tenant_budget_tokens=policy.tenant_budget_tokens,
                engine_budget_tokens=policy.engine_budget_tokens,
                max_ended_remembered=policy.max_ended_remembered,
                checkpoint_lag_s=policy.checkpoint_max_lag_s,
            ),
            clock,
        )
        self.hub = WatchHub(queue_capacity=policy.watch_queue_size, max_subscribers=policy.max_watchers)
        self.serving = False
        # Idempotency: a grant's request id -> its outcome, the oldest forgotten past max_request_ids.
        self._requests: FIFOCache[str, _Pending] = FIFOCache(maxsize=policy.max_request_ids)
        # Grants whose store write (or take-back) runs: not cancelled with their RPC, awaited by step_down.
        self._granting: set[asyncio.Task[None]] = set()
        self.taken_back = 0  # grants that landed but were never acknowledged, deleted again
        # Take-backs of grants whose write step_down stopped waiting for (they outlive the step-down).
        self._late_take_backs: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._end_slots = asyncio.Semaphore(_END_CONCURRENCY)
        self._unfinished: list[Ended] = []  # ends whose store cleanup failed; retried
        self.renewals = 0
        self._inflight: set[asyncio.Task[None]] = set()
        # Without one (unit tests), metrics go to a private registry nobody scrapes.
        self.metrics = metrics or LeaseMetrics(CollectorRegistry())
        self.metrics.bind(
            LeaseState(
                renewals=lambda: self.renewals,
                live_by_kind=lambda: self.table.live_by_kind,
                watch_subscribers=lambda: self.hub.count,
                is_leader=lambda: self.serving,
            )
        )

    # --- leadership ---

    def not_leader(self) -> Unavailable:
        """UNAVAILABLE / NOT_LEADER naming the leader when known: what every leadership change answers."""
        leader = self._leader_hint()
        return Unavailable(
            Reason.NOT_LEADER,
            f"this lease-manager replica is not the leader; leader: {leader or 'unknown, retry'}",
            metadata={"leader": leader or ""},
        )

    def require_serving(self) -> None:
        if not self.serving:
            raise self.not_leader()

    async def take_over(self) -> None:
        """Load every acknowledged lease and start serving. No lease expires early because of
        the failover: each deadline becomes max(persisted deadline, now + ttl) within max lifetime."""
        # Loading 100k records would trigger a string of ever larger full garbage collections (seconds on a
        # busy host, all of it failover time); the records hold no cycles, so collect once afterwards instead.
        collecting = gc.isenabled()
        gc.disable()
        try:
            records = await self.persistence.load()
            self.table.clear()
            now = self.table.clock()
            self._requests.clear()
            loop = asyncio.get_running_loop()
            for record in records:
                record.persisted_deadline = record.deadline
                record.deadline = max(record.deadline, min(now + record.ttl_s, record.max_deadline))
                self.table.restore(record)
                if record.request_id:  # records come in id (= grant) order: the newest are kept
                    future: asyncio.Future[int] = loop.create_future()
                    future.set_result(record.lease_id)
                    self._requests[record.request_id] = _Pending(GrantSpec.of(record), future)
        finally:
            if collecting:
                gc.enable()
        self.serving = True
        self._tasks = [asyncio.create_task(self._expiry_loop()), asyncio.create_task(self._end_retry_loop())]
        if self.policy.checkpoint_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._checkpoint_loop()))
        if self.policy.stats_log_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._stats_loop()))
        log.info("serving %d recovered leases", len(records))

    async def step_down(self) -> None:
        self.serving = False
        tasks, self._tasks = self._tasks, []
        tasks.extend(self._inflight)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # Grants whose write is in flight: wait for each outcome (bounded by the store timeout), so that a
        # write that lands now is taken back here (nobody was told of it) before the leader key is released.
        if self._granting:
            _, left = await asyncio.wait(set(self._granting), timeout=self._drain_s())
            for task in left:
                task.cancel()
            for task in left:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.hub.close_all("leader changed")
        error = self.not_leader()
        for pending in self._requests.values():
            _settle(pending.future, error)
        self._requests.clear()
        self._unfinished.clear()
        self.table.clear()

    def _drain_s(self) -> float:
        return self.policy.store_timeout_s * (1 + _TAKE_BACK_ATTEMPTS) + 1.0

    def _fenced(self, exc: BaseException) -> None:
        if isinstance(exc, NotLeaderAnymore):
            self._on_fenced()

    # --- grant ---

    async def grant(
        self, spec: GrantSpec, request_id: str = "", time_left: TimeLeft = lambda: None
    ) -> tuple[LeaseRecord, list[int]]:
        """Grant a lease; returns it once it is in the table and the store.

        The store write runs in its own task, not cancelled with the RPC: if the caller is gone when it
        lands (deadline passed, cancelled) or leadership was lost meanwhile, the lease is taken back out of
        both; so an acknowledged grant is in both, an unacknowledged one in neither. ``time_left``: what
        is left of the caller's deadline (None: no deadline)."""
        self.require_serving()
        if request_id:
            seen = self._requests.get(request_id)
            if seen is not None:
                return await self._replay(spec, request_id, seen, time_left), []
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)  # a failure nobody retried is not an "unretrieved" error
        pending = _Pending(spec, future)
        record, evicted = self.table.grant(
            kind=spec.kind,
            tenant=spec.tenant,
            engine_id=spec.engine_id,
            model=spec.model,
            conversation_key=spec.conversation_key,
            retained_tokens=spec.retained_tokens,
            ttl_s=spec.ttl_s,
            max_lifetime_s=self.policy.max_lifetime_s,
            request_id=request_id,
        )
        if request_id:
            self._requests[request_id] = pending
        task = asyncio.create_task(self._commit(pending, record, evicted))
        self._granting.add(task)
        task.add_done_callback(self._granting.discard)
        await self._wait(pending, time_left)
        return record, [e.record.lease_id for e in evicted]

    @staticmethod
    async def _wait(pending: _Pending, time_left: TimeLeft) -> int:
        pending.waiters.append(time_left)
        try:
            return await asyncio.shield(pending.future)
        finally:
            pending.waiters.remove(time_left)

    async def _commit(self, pending: _Pending, record: LeaseRecord, evicted: list[Ended]) -> None:
        """Write the grant; then acknowledge it, or take it back out of the table and the store."""
        value = self.persistence.encode(record)
        try:
            if evicted:
                await self.finish(evicted)
            await self.persistence.save_granted(record, value)
        except asyncio.CancelledError:  # step_down gave up waiting: outcome unknown, nobody acknowledged
            self._undo(pending, record)
            _settle(pending.future, self.not_leader())
            # The write may still land: take it back on its own, after the step-down (bounded by its retries).
            late = asyncio.get_running_loop().create_task(self._take_back(record, value))
            self._late_take_backs.add(late)
            late.add_done_callback(self._late_take_backs.discard)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the grant; the waiters get it
            self._undo(pending, record)
            if isinstance(exc, NotLeaderAnymore):
                # The fence failed on the attempt that answered, but an earlier attempt of the same write
                # (they are resent) may have landed before our leader lease went. A lost fence never comes
                # back, so no attempt can land after this take-back: it is final.
                self._on_fenced()
                _settle(pending.future, self.not_leader())
            else:
                _settle(pending.future, exc)  # a timeout or store error: the write may still land
            await self._take_back(record, value)
            return
        if not self.serving or not pending.awaited():
            self._undo(pending, record)
            _settle(
                pending.future,
                self.not_leader()
                if not self.serving
                else DeadlineExceeded("", "the deadline left no time to answer; the grant was taken back"),
            )
            await self._take_back(record, value)
            return
        pending.future.set_result(record.lease_id)
        self.metrics.granted(record.kind)
        self.hub.publish(ACTIVE, record)

    def _undo(self, pending: _Pending, record: LeaseRecord) -> None:
        """Out of the table (and its request_id forgotten: a retry is a new grant)."""
        self.table.end(record.lease_id, R.REVOKE_REASON_UNSPECIFIED, cascade=False)
        if record.request_id and self._requests.get(record.request_id) is pending:
            del self._requests[record.request_id]

    async def _take_back(self, record: LeaseRecord, value: bytes) -> None:
        try:
            taken = await retry(
                lambda: self.persistence.take_back(record, value),
                Backoff(_END_RETRY_S, _END_RETRY_S),  # the same pause between all attempts
                attempts=_TAKE_BACK_ATTEMPTS,
            )
        except Exception as exc:  # noqa: BLE001 - retried, then logged
            log.error(
                "could not take back unacknowledged lease %d (%s); if its write landed it stays "
                "until its TTL passes unrenewed",
                record.lease_id,
                exc,
            )
            return
        if taken:
            self.taken_back += 1
            log.info("grant of lease %d was not acknowledged; taken back", record.lease_id)

    async def _replay(self, spec: GrantSpec, request_id: str, pending: _Pending, time_left: TimeLeft) -> LeaseRecord:
        if pending.spec != spec:
            raise AlreadyExists(
                Reason.IDEMPOTENCY_CONFLICT,
                f"request_id {request_id!r} was used with a different request",
                metadata={"field": "request_id"},
            )
        lease_id = await self._wait(pending, time_left)
        record = self.table.leases.get(lease_id)
        if record is None:
            raise NotFound(
                Reason.LEASE_NOT_FOUND,
                f"the lease granted for request_id {request_id!r} has already ended "
                f"({reason_name(self.table.ended_reason(lease_id))})",
                metadata={"lease_id": str(lease_id)},
            )
        return record

    # --- renew ---

    def renew(self, lease_id: int, tenant: str | None) -> LeaseRecord | None:
        """Renew in memory; None if gone or not the caller's (tenant principals renew their own only)."""
        record = self.table.leases.get(lease_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            return None
        self.table.renew(lease_id)
        self.renewals += 1
        if self.hub.has_subscribers(record.engine_id):
            self.hub.publish(RENEWED, record)
        return record

    # --- end ---

    async def revoke(self, lease_id: int, reason: int, tenant: str | None) -> LeaseRecord:
        self.require_serving()
        record = self.get(lease_id, tenant)
        try:
            await self.finish(self.table.end(lease_id, reason))
        except NotLeaderAnymore:
            raise self.not_leader() from None
        return record

    def get(self, lease_id: int, tenant: str | None) -> LeaseRecord:
        record = self.table.leases.get(lease_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            ended = self.table.ended_reason(lease_id) if record is None else R.REVOKE_REASON_UNSPECIFIED
            why = f" (ended: {reason_name(ended)})" if ended else ""
            raise NotFound(Reason.LEASE_NOT_FOUND, f"no lease {lease_id}{why}", metadata={"lease_id": str(lease_id)})
        return record

    async def finish(self, ended: list[Ended]) -> None:
        """Clean up the store for ended leases, then tell the engines: their blocks may be freed
        only once no registry entry points at them any more. A failed cleanup is retried."""
        if not ended:
            return
        self.metrics.count_ended(ended)  # ended in the table now, whatever the store cleanup does
        try:
            async with self._end_slots:
                await self.persistence.delete_ended(ended)
        except Exception as exc:
            self._fenced(exc)
            if self.serving and not isinstance(exc, NotLeaderAnymore):
                log.warning("store cleanup of %d ended leases failed (%s); will retry", len(ended), exc)
                self._unfinished.extend(ended)
            raise
        self._publish_ended(ended)

    def _publish_ended(self, ended: list[Ended]) -> None:
        for item in ended:
            self.hub.publish(ENDED, item.record, item.reason)

    # --- loops ---

    async def _expiry_loop(self) -> None:
        tick = self.policy.expiry_tick_s
        while True:
            ended = self.table.pop_expired()
            if ended:
                self._background(self._finish_quietly(ended))
            # Wake at the next deadline, at most one tick away (grants may bring an earlier one).
            next_deadline = self.table.next_deadline()
            wait = tick if next_deadline is None else min(tick, max(0.0, next_deadline - self.table.clock()))
            await asyncio.sleep(wait)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _finish_quietly(self, ended: list[Ended]) -> None:
        with contextlib.suppress(Exception):
            await self.finish(ended)

    async def _end_retry_loop(self) -> None:
        while True:
            await asyncio.sleep(_END_RETRY_S)
            if self._unfinished:
                batch, self._unfinished = self._unfinished, []
                try:
                    async with self._end_slots:
                        await self.persistence.delete_ended(batch)
                    self._publish_ended(batch)
                except Exception as exc:  # noqa: BLE001 - keep retrying while leading
                    self._fenced(exc)
                    self._unfinished.extend(batch)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.checkpoint_interval_s)
            dirty = self.table.take_dirty(self.policy.checkpoint_max_puts)
            if not dirty:
                continue
            try:
                await self.persistence.checkpoint(dirty, lambda i: i in self.table.leases)
            except Exception as exc:  # noqa: BLE001 - retried at the next interval
                self._fenced(exc)
                self.table.mark_dirty(dirty)
                if not isinstance(exc, StoreNoSpace):  # the store logs a NOSPACE episode once
                    log.warning("deadline checkpoint of %d leases failed: %s", len(dirty), exc)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.stats_log_interval_s)
            c = self.persistence.counters
            log.info(
                "stats leases=%d renewals=%d watchers=%d store_txns=%d store_puts=%d store_deletes=%d store_gets=%d",
                len(self.table),
                self.renewals,
                self.hub.count,
                c.txns,
                c.puts,
                c.deletes,
                c.gets,
            )
