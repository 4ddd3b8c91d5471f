"""The in-memory lease table of the leader: pure, synchronous, clock injected.

Renewals only touch memory (O(1)); the store sees grants, ends and periodic
deadline checkpoints (``take_dirty``). Expiry uses a min-heap of deadlines that
holds at most one entry per live lease: a renewal only moves the deadline
later, so a popped entry older than its lease's deadline is pushed back
instead of being updated on every renewal.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvbridge.errors import Reason, ResourceExhausted
from kvbridge.lease.v1 import lease_pb2
from kvbridge.types.v1 import types_pb2

Clock = Callable[[], float]
ConversationId = tuple[str, str, str]  # (tenant, model, conversation_key)

ENTRY = lease_pb2.LEASE_KIND_ENTRY
NODE = lease_pb2.LEASE_KIND_NODE
R = types_pb2.RevokeReason
_ID_COUNTER_BITS = 20  # lease id = unix ms << 20 | counter: unique across restarts and failovers


def reason_name(reason: int) -> str:
    return R.Name(reason)  # type: ignore[arg-type]


@dataclass(slots=True, eq=False)
class LeaseRecord:
    lease_id: int
    kind: int
    tenant: str
    engine_id: str
    model: str
    conversation_key: str
    retained_tokens: int
    ttl_s: float
    grant_time: float
    max_deadline: float
    deadline: float
    last_renew_time: float
    # Deadline last written to the store (checkpoints write it back once it lags too far).
    persisted_deadline: float = 0.0
    # GrantLeaseRequest.request_id of its grant ("": none), persisted so replays survive a failover.
    request_id: str = ""

    @property
    def conversation(self) -> ConversationId:
        return (self.tenant, self.model, self.conversation_key)


@dataclass(frozen=True, slots=True)
class Ended:
    record: LeaseRecord
    reason: int  # types.v1.RevokeReason


@dataclass(frozen=True, slots=True)
class TableLimits:
    max_leases: int = 1_000_000
    tenant_budget_tokens: int = 0  # 0: unlimited
    engine_budget_tokens: int = 0
    max_ended_remembered: int = 100_000
    # A renewal marks a lease for the next checkpoint once its deadline runs this far ahead of the stored one.
    checkpoint_lag_s: float = 0.0


class LeaseTable:
    def __init__(self, limits: TableLimits = TableLimits(), clock: Clock = time.time) -> None:
        self.limits = limits
        self.clock = clock
        self.leases: dict[int, LeaseRecord] = {}
        self._heap: list[tuple[float, int]] = []
        # ENTRY leases per tenant / engine in oldest-idle-first order (renewal moves to the end).
        self._by_tenant: dict[str, OrderedDict[int, None]] = {}
        self._by_engine: dict[str, OrderedDict[int, None]] = {}
        self._nodes: dict[str, set[int]] = {}
        self._conversations: dict[ConversationId, int] = {}
        self.tenant_tokens: dict[str, int] = {}
        self.engine_tokens: dict[str, int] = {}
        self._dirty: set[int] = set()
        # Live leases per kind, kept as they come and go (read by metrics scrapes on another thread).
        self.live_by_kind: dict[int, int] = {}
        self._ended: OrderedDict[int, int] = OrderedDict()
        self._last_id = 0

    def __len__(self) -> int:
        return len(self.leases)

    # --- ids ---

    def new_id(self) -> int:
        candidate = int(self.clock() * 1000) << _ID_COUNTER_BITS
        self._last_id = max(self._last_id + 1, candidate)
        return self._last_id

    # --- grant ---

    def grant(
        self,
        *,
        kind: int,
        tenant: str,
        engine_id: str,
        model: str = "",
        conversation_key: str = "",
        retained_tokens: int = 0,
        ttl_s: float,
        max_lifetime_s: float,
        request_id: str = "",
    ) -> tuple[LeaseRecord, list[Ended]]:
        """A new live lease, and the leases revoked (BUDGET) to make room for it."""
        if len(self.leases) >= self.limits.max_leases:
            raise ResourceExhausted(Reason.OVERLOADED, f"lease table is full ({self.limits.max_leases} leases)")
        evicted: list[Ended] = []
        if kind == ENTRY and retained_tokens:
            victims = self._budget_victims(tenant, engine_id, retained_tokens)
            for victim in victims:
                evicted.extend(self.end(victim.lease_id, R.REVOKE_REASON_BUDGET))
        now = self.clock()
        max_deadline = now + max_lifetime_s
        record = LeaseRecord(
            lease_id=self.new_id(),
            kind=kind,
            tenant=tenant,
            engine_id=engine_id,
            model=model,
            conversation_key=conversation_key,
            retained_tokens=retained_tokens if kind == ENTRY else 0,
            ttl_s=ttl_s,
            grant_time=now,
            max_deadline=max_deadline,
            deadline=min(now + ttl_s, max_deadline),
            last_renew_time=now,
            request_id=request_id,
        )
        record.persisted_deadline = record.deadline
        self._insert(record)
        return record, evicted

    def _budget_victims(self, tenant: str, engine_id: str, tokens: int) -> list[LeaseRecord]:
        victims: dict[int, LeaseRecord] = {}
        dimensions = (
            ("tenant", self.limits.tenant_budget_tokens, tenant, self.tenant_tokens, self._by_tenant),
            ("engine", self.limits.engine_budget_tokens, engine_id, self.engine_tokens, self._by_engine),
        )
        for what, budget, owner, used_by, oldest_idle_first in dimensions:
            if not budget:
                continue
            if tokens > budget:
                raise ResourceExhausted(
                    Reason.BUDGET_EXCEEDED, f"{tokens} retained tokens exceed the whole {what} budget of {budget}"
                )
            used = used_by.get(owner, 0) - sum(
                v.retained_tokens for v in victims.values() if (v.tenant if what == "tenant" else v.engine_id) == owner
            )
            for lease_id in oldest_idle_first.get(owner, ()):
                if used + tokens <= budget:
                    break
                victim = self.leases[lease_id]
                # A grant makes room only among its own tenant's leases: one tenant never evicts another's.
                if lease_id not in victims and victim.retained_tokens and victim.tenant == tenant:
                    victims[lease_id] = victim
                    used -= victim.retained_tokens
            if used + tokens > budget:
                raise ResourceExhausted(
                    Reason.BUDGET_EXCEEDED,
                    f"the {what} budget of {budget} retained tokens is held by other tenants' leases",
                )
        return list(victims.values())

    def _insert(self, record: LeaseRecord) -> None:
        lease_id = record.lease_id
        self.leases[lease_id] = record
        self.live_by_kind[record.kind] = self.live_by_kind.get(record.kind, 0) + 1
        self._last_id = max(self._last_id, lease_id)
        heapq.heappush(self._heap, (record.deadline, lease_id))
        if record.kind == NODE:
            self._nodes.setdefault(record.engine_id, set()).add(lease_id)
            return
        self._by_tenant.setdefault(record.tenant, OrderedDict())[lease_id] = None
        self._by_engine.setdefault(record.engine_id, OrderedDict())[lease_id] = None
        self.tenant_tokens[record.tenant] = self.tenant_tokens.get(record.tenant, 0) + record.retained_tokens
        self.engine_tokens[record.engine_id] = self.engine_tokens.get(record.engine_id, 0) + record.retained_tokens
        if record.conversation_key:
            self._conversations[record.conversation] = lease_id

    def restore(self, record: LeaseRecord) -> None:
        """Adopt a lease loaded from the store (takeover, restart)."""
        if record.lease_id in self.leases:
            return
        self._insert(record)

    # --- renew ---

    def renew(self, lease_id: int) -> LeaseRecord | None:
        """Push the deadline to now + ttl (capped by max lifetime); None if the lease is gone."""
        record = self.leases.get(lease_id)
        if record is None:
            return None
        now = self.clock()
        deadline = min(now + record.ttl_s, record.max_deadline)
        if deadline > record.deadline:
            record.deadline = deadline
            if deadline - record.persisted_deadline > self.limits.checkpoint_lag_s:
                self._dirty.add(lease_id)
        record.last_renew_time = now
        if record.kind == ENTRY:
            by_tenant = self._by_tenant.get(record.tenant)
            if by_tenant is not None:
                by_tenant.move_to_end(lease_id)
            by_engine = self._by_engine.get(record.engine_id)
            if by_engine is not None:
                by_engine.move_to_end(lease_id)
        return record

    def conversation_lease(self, conversation: ConversationId) -> int | None:
        return self._conversations.get(conversation)

    # --- end ---

    def end(self, lease_id: int, reason: int, *, cascade: bool = True) -> list[Ended]:
        """Remove a lease; a node lease that was its engine's last also ends the engine's ENTRY leases
        (unless ``cascade`` is False: undoing a grant that was never acknowledged)."""
        record = self.leases.pop(lease_id, None)
        if record is None:
            return []
        self._dirty.discard(lease_id)
        self.live_by_kind[record.kind] -= 1
        self._remember(lease_id, reason)
        ended = [Ended(record, reason)]
        if record.kind == NODE:
            nodes = self._nodes.get(record.engine_id)
            if nodes is not None:
                nodes.discard(lease_id)
                if not nodes:
                    del self._nodes[record.engine_id]
                    for entry_id in list(self._by_engine.get(record.engine_id, ())) if cascade else ():
                        ended.extend(self.end(entry_id, R.REVOKE_REASON_ENGINE_GONE))
            return ended
        self._drop_from(self._by_tenant, record.tenant, lease_id)
        self._drop_from(self._by_engine, record.engine_id, lease_id)
        self._subtract(self.tenant_tokens, record.tenant, record.retained_tokens)
        self._subtract(self.engine_tokens, record.engine_id, record.retained_tokens)
        if self._conversations.get(record.conversation) == lease_id:
            del self._conversations[record.conversation]
        return ended

    @staticmethod
    def _drop_from(index: dict[str, OrderedDict[int, None]], key: str, lease_id: int) -> None:
        order = index.get(key)
        if order is not None:
            order.pop(lease_id, None)
            if not order:
                del index[key]

    @staticmethod
    def _subtract(totals: dict[str, int], key: str, tokens: int) -> None:
        left = totals.get(key, 0) - tokens
        if left > 0:
            totals[key] = left
        else:
            totals.pop(key, None)

    def _remember(self, lease_id: int, reason: int) -> None:
        if self.limits.max_ended_remembered <= 0:
            return
        self._ended[lease_id] = reason
        if len(self._ended) > self.limits.max_ended_remembered:
            self._ended.popitem(last=False)

    def ended_reason(self, lease_id: int) -> int:
        """Why a recently ended lease ended (UNSPECIFIED: unknown or long gone)."""
        return self._ended.get(lease_id, R.REVOKE_REASON_UNSPECIFIED)

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, limit: int = 10_000) -> list[Ended]:
        """End (up to ``limit``) leases whose deadline has passed."""
        now = self.clock()
        ended: list[Ended] = []
        heap = self._heap
        while heap and heap[0][0] <= now and len(ended) < limit:
            when, lease_id = heapq.heappop(heap)
            record = self.leases.get(lease_id)
            if record is None:
                continue  # ended some other way
            if record.deadline > when:
                heapq.heappush(heap, (record.deadline, lease_id))
                continue
            reason = R.REVOKE_REASON_MAX_LIFETIME if record.deadline >= record.max_deadline else R.REVOKE_REASON_EXPIRED
            ended.extend(self.end(lease_id, reason))
        return ended

    # --- checkpoints and views ---

    def take_dirty(self, limit: int = 0) -> list[LeaseRecord]:
        """Up to ``limit`` (0: all) live leases due for a checkpoint; the rest stay due."""
        if limit <= 0 or len(self._dirty) <= limit:
            ids, self._dirty = self._dirty, set()
        else:
            ids = {self._dirty.pop() for _ in range(limit)}
        return [self.leases[i] for i in ids if i in self.leases]

    def mark_dirty(self, records: Iterable[LeaseRecord]) -> None:
        """Put back a checkpoint that failed to be written."""
        self._dirty.update(r.lease_id for r in records if r.lease_id in self.leases)

    def of_engine(self, engine_id: str) -> list[LeaseRecord]:
        ids = [*self._nodes.get(engine_id, ()), *self._by_engine.get(engine_id, ())]
        return [self.leases[i] for i in ids]

    def iter_from(self, after_id: int) -> Iterator[LeaseRecord]:
        """Live leases with id > after_id, ascending: ids only grow and a takeover restores in key
        (= id) order before granting, so the dict's insertion order is id order."""
        for lease_id, record in self.leases.items():
            if lease_id > after_id:
                yield record

    def clear(self) -> None:
        self.__init__(self.limits, self.clock)  # type: ignore[misc]
