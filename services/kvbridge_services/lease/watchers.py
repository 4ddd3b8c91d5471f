"""Fan-out of lease events to WatchLeases subscribers, one engine each.

Each subscriber has a bounded map of pending events keyed by lease id: a
renewal of a lease already pending only refreshes it (the record is read when
the message is built), so a fast-renewing engine costs one slot per lease, not
one per renewal. A subscriber whose map overflows is dropped; it reconnects
and re-syncs from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from kvbridge.lease.v1 import lease_pb2

from .codec import to_proto
from .table import LeaseRecord

EventType = lease_pb2.LeaseEvent.Type
ACTIVE = lease_pb2.LeaseEvent.TYPE_ACTIVE
RENEWED = lease_pb2.LeaseEvent.TYPE_RENEWED
ENDED = lease_pb2.LeaseEvent.TYPE_ENDED


@dataclass(eq=False)
class Subscriber:
    engine_id: str
    capacity: int
    pending: dict[int, tuple[int, LeaseRecord, int]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    overflowed: bool = False
    closed_reason: str = ""

    def offer(self, event_type: int, record: LeaseRecord, reason: int = 0) -> None:
        if self.overflowed:
            return
        previous = self.pending.get(record.lease_id)
        if previous is not None and previous[0] == ACTIVE and event_type == RENEWED:
            event_type = ACTIVE  # not yet delivered as granted: still announce it as ACTIVE
        self.pending[record.lease_id] = (event_type, record, reason)
        if len(self.pending) > self.capacity:
            self.overflowed = True
            self.pending.clear()
        self.wake.set()

    def close(self, reason: str) -> None:
        self.closed_reason = reason
        self.wake.set()

    def drain(self, limit: int) -> list[lease_pb2.LeaseEvent]:
        if len(self.pending) <= limit:
            batch, self.pending = self.pending, {}
        else:
            rest = iter(self.pending.items())
            batch = dict(itertools.islice(rest, limit))
            self.pending = dict(rest)
        if not self.pending:
            self.wake.clear()
        events: list[lease_pb2.LeaseEvent] = []
        for event_type, record, reason in batch.values():
            event = lease_pb2.LeaseEvent(type=event_type, reason=reason)  # type: ignore[arg-type]
            to_proto(record, event.lease)
            events.append(event)
        return events


class WatchHub:
    def __init__(self, *, queue_capacity: int, max_subscribers: int) -> None:
        self._capacity = queue_capacity
        self._max = max_subscribers
        self._by_engine: dict[str, set[Subscriber]] = {}
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def subscribe(self, engine_id: str) -> Subscriber | None:
        """None when the subscriber cap is reached."""
        if self._count >= self._max:
            return None
        sub = Subscriber(engine_id, self._capacity)
        self._by_engine.setdefault(engine_id, set()).add(sub)
        self._count += 1
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._by_engine.get(sub.engine_id)
        if subs is not None and sub in subs:
            subs.discard(sub)
            self._count -= 1
            if not subs:
                del self._by_engine[sub.engine_id]

    def has_subscribers(self, engine_id: str) -> bool:
        return engine_id in self._by_engine

    def publish(self, event_type: int, record: LeaseRecord, reason: int = 0) -> None:
        subs = self._by_engine.get(record.engine_id)
        if subs:
            for sub in subs:
                sub.offer(event_type, record, reason)

    def close_all(self, reason: str) -> None:
        for subs in self._by_engine.values():
            for sub in subs:
                sub.close(reason)
