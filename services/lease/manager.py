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
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import AlreadyExists, NotFound, Reason, Unavailable
from kvbridge.types.v1 import types_pb2
from prometheus_client import CollectorRegistry

from .metrics import LeaseMetrics, LeaseState
from .persistence import LeasePersistence, NotLeaderAnymore
from .policy import LeasePolicy
from .table import Clock, Ended, LeaseRecord, LeaseTable, TableLimits, reason_name
from .watchers import ACTIVE, ENDED, RENEWED, WatchHub

log = logging.getLogger(__name__)
R = types_pb2.RevokeReason
_END_CONCURRENCY = 4
_END_RETRY_S = 0.5


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True, slots=True)
class GrantSpec:
    kind: int
    tenant: str
    engine_id: str
    model: str
    conversation_key: str
    retained_tokens: int
    ttl_s: float


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
        self._requests: OrderedDict[str, tuple[GrantSpec, asyncio.Future[int]]] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        self._end_slots = asyncio.Semaphore(_END_CONCURRENCY)
        self._unfinished: list[Ended] = []  # ends whose store cleanup failed; retried
        self.renewals = 0
        self._inflight: set[asyncio.Task[None]] = set()
        # Without one (unit tests), metrics go to a private registry nobody scrapes.
        self.metrics = metrics or LeaseMetrics(CollectorRegistry())
        self.metrics.bind(LeaseState(
            renewals=lambda: self.renewals, live_by_kind=lambda: self.table.live_by_kind,
            watch_subscribers=lambda: self.hub.count, is_leader=lambda: self.serving,
        ))

    # --- leadership ---

    def require_serving(self) -> None:
        if not self.serving:
            leader = self._leader_hint()
            raise Unavailable(
                Reason.NOT_LEADER,
                f"this lease-manager replica is not the leader; leader: {leader or 'unknown, retry'}",
                metadata={"leader": leader or ""},
            )

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
            for record in records:
                record.persisted_deadline = record.deadline
                record.deadline = max(record.deadline, min(now + record.ttl_s, record.max_deadline))
                self.table.restore(record)
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
        self.hub.close_all("leader changed")
        for _, future in self._requests.values():
            if not future.done():
                future.set_exception(NotLeaderAnymore())
        self._requests.clear()
        self._unfinished.clear()
        self.table.clear()

    def _fenced(self, exc: BaseException) -> None:
        if isinstance(exc, NotLeaderAnymore):
            self._on_fenced()

    # --- grant ---

    async def grant(self, spec: GrantSpec, request_id: str = "") -> tuple[LeaseRecord, list[int]]:
        self.require_serving()
        if request_id:
            seen = self._requests.get(request_id)
            if seen is not None:
                return await self._replay(spec, request_id, *seen), []
            future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieve)  # a failure nobody retried is not an "unretrieved" error
            self._requests[request_id] = (spec, future)
            while len(self._requests) > self.policy.max_request_ids:
                self._requests.popitem(last=False)
        try:
            record, evicted = self.table.grant(
                kind=spec.kind, tenant=spec.tenant, engine_id=spec.engine_id, model=spec.model,
                conversation_key=spec.conversation_key, retained_tokens=spec.retained_tokens, ttl_s=spec.ttl_s,
                max_lifetime_s=self.policy.max_lifetime_s,
            )
            try:
                if evicted:
                    await self.finish(evicted)
                await self.persistence.save_granted(record)
            except BaseException:
                self.table.end(record.lease_id, R.REVOKE_REASON_UNSPECIFIED, cascade=False)
                raise
        except BaseException as exc:
            self._fenced(exc)
            if request_id:
                self._requests.pop(request_id, None)
                future.set_exception(exc if isinstance(exc, Exception) else NotLeaderAnymore())
            raise
        if request_id:
            future.set_result(record.lease_id)
        self.metrics.granted(record.kind)
        self.hub.publish(ACTIVE, record)
        return record, [e.record.lease_id for e in evicted]

    async def _replay(
        self, spec: GrantSpec, request_id: str, first: GrantSpec, future: asyncio.Future[int]
    ) -> LeaseRecord:
        if first != spec:
            raise AlreadyExists(
                Reason.IDEMPOTENCY_CONFLICT, f"request_id {request_id!r} was used with a different request",
                metadata={"field": "request_id"},
            )
        lease_id = await asyncio.shield(future)
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
        await self.finish(self.table.end(lease_id, reason))
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
                log.warning("deadline checkpoint of %d leases failed: %s", len(dirty), exc)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.stats_log_interval_s)
            c = self.persistence.counters
            log.info(
                "stats leases=%d renewals=%d watchers=%d store_txns=%d store_puts=%d store_deletes=%d store_gets=%d",
                len(self.table), self.renewals, self.hub.count, c.txns, c.puts, c.deletes, c.gets,
            )

