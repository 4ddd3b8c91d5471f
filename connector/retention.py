"""Decode-side retention table: which finished requests keep their KV blocks, and until when.

Pure bookkeeping (no vLLM, no gRPC) so the scheduler-side rules are unit-testable:

- A retained entry is held until a *hold deadline* on the scheduler's clock. It
  starts at ``now + fallback_ttl``; while the control plane confirms the entry's
  lease is alive (grant, snapshot, renewal, or simply a connected watch stream)
  the deadline keeps being pushed to ``now + fallback_ttl``. When the control
  plane is unreachable nothing extends it, so blocks are freed at most
  ``fallback_ttl`` after the last confirmation.
- A lease that ended (revoked, expired, superseded, engine gone) releases its
  blocks ``free_grace_s`` later: a prefill the gateway sent just before the end
  may still be reading them (a one-sided NIXL READ D cannot see), and freed
  blocks get reused. Memory pressure cuts the grace short.
- Below the free-KV watermark, or above the entry cap, entries are evicted oldest
  idle first; their leases are revoked with EVICTED_MEMORY_PRESSURE and their
  blocks freed at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvbridge_connector.params import ConversationRef

Clock = Callable[[], float]


@dataclass(slots=True)
class RetainedEntry:
    request_id: str
    num_blocks: int
    token_count: int
    conversation: ConversationRef | None
    hold_deadline: float
    last_used: float
    lease_id: int = 0
    # The deadline the worker was last told (re-sent when it needs extending).
    sent_deadline: float = 0.0
    released: bool = False


@dataclass(slots=True)
class Decisions:
    """What the scheduler must do this step."""

    # request id -> hold deadline (scheduler clock) to send to the worker.
    deadlines: dict[str, float] = field(default_factory=dict)
    # Requests whose blocks must be freed now.
    release: set[str] = field(default_factory=set)
    # Leases to revoke: (lease id, reason name).
    revoke: list[tuple[int, str]] = field(default_factory=list)


class RetentionTable:
    def __init__(self, clock: Clock, fallback_ttl_s: float, max_entries: int, free_kv_watermark: float,
                 free_grace_s: float = 0.0) -> None:
        self._clock = clock
        self._free_grace_s = free_grace_s
        # Ended entries whose blocks are freed at the given time (insertion order = free order).
        self._draining: dict[str, float] = {}
        self._fallback_ttl_s = fallback_ttl_s
        self._max_entries = max_entries
        self._watermark = free_kv_watermark
        self._entries: dict[str, RetainedEntry] = {}
        self._by_lease: dict[int, str] = {}
        # Leases that ended before their grant reached us (bounded: trimmed FIFO).
        self._ended_leases: dict[int, None] = {}
        self._connected = False
        self._pending = Decisions()

    # ---- queries -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> RetainedEntry | None:
        return self._entries.get(request_id)

    def retained_blocks(self) -> int:
        return sum(e.num_blocks for e in self._entries.values() if not e.released)

    # ---- events --------------------------------------------------------
    def retain(
        self, request_id: str, num_blocks: int, token_count: int, conversation: ConversationRef | None
    ) -> float:
        """Start holding a finished request's blocks; returns the first hold deadline."""
        now = self._clock()
        deadline = now + self._fallback_ttl_s
        self._entries[request_id] = RetainedEntry(
            request_id, num_blocks, token_count, conversation, deadline, now, sent_deadline=deadline,
        )
        return deadline

    def set_connected(self, connected: bool) -> None:
        self._connected = connected

    def bind_lease(self, request_id: str, lease_id: int) -> None:
        """The entry's lease was granted and the entry registered."""
        entry = self._entries.get(request_id)
        if entry is None or entry.released:
            # Freed while the grant was in flight: the lease must not outlive the blocks.
            self._pending.revoke.append((lease_id, "REVOKE_REASON_EXPIRED"))
            return
        if lease_id in self._ended_leases:
            self._release(entry, grace=True)
            return
        entry.lease_id = lease_id
        self._by_lease[lease_id] = request_id
        self._confirm(entry)

    def lease_alive(self, lease_id: int) -> None:
        """ACTIVE or RENEWED: a renewal also marks the entry as recently used."""
        request_id = self._by_lease.get(lease_id)
        if request_id is not None:
            entry = self._entries[request_id]
            entry.last_used = self._clock()
            self._confirm(entry)

    def lease_ended(self, lease_id: int) -> None:
        request_id = self._by_lease.get(lease_id)
        if request_id is None:
            self._ended_leases[lease_id] = None
            while len(self._ended_leases) > 4 * self._max_entries:
                del self._ended_leases[next(iter(self._ended_leases))]
            return
        self._release(self._entries[request_id], grace=True)

    def snapshot(self, live_lease_ids: Iterable[int]) -> None:
        """A (re)connected watch listed every live lease: free what is not in it."""
        live = set(live_lease_ids)
        for entry in list(self._entries.values()):
            if entry.lease_id and not entry.released:
                if entry.lease_id in live:
                    self._confirm(entry)
                else:
                    self._release(entry, grace=True)

    def freed(self, request_id: str) -> None:
        """vLLM freed the blocks (finished sending): forget the entry."""
        entry = self._entries.pop(request_id, None)
        self._draining.pop(request_id, None)
        if entry is None:
            return
        if entry.lease_id:
            self._by_lease.pop(entry.lease_id, None)
            if not entry.released:
                # Freed by the fallback deadline while the lease may still live: end it.
                self._pending.revoke.append((entry.lease_id, "REVOKE_REASON_EXPIRED"))

    # ---- per step ------------------------------------------------------
    def step(self, free_blocks: int | None, total_blocks: int | None) -> Decisions:
        """Extend confirmed holds, evict under pressure; returns and clears pending decisions."""
        now = self._clock()
        if self._connected:
            for entry in self._entries.values():
                if entry.lease_id and not entry.released:
                    self._confirm(entry, now)
        self._evict(free_blocks, total_blocks)
        while self._draining:
            request_id, free_at = next(iter(self._draining.items()))
            if free_at > now:
                break
            del self._draining[request_id]
            self._pending.release.add(request_id)
        for entry in self._entries.values():
            if entry.released:
                continue
            if entry.hold_deadline > entry.sent_deadline:
                # Tell the worker only when half of the last extension is used up.
                remaining = entry.sent_deadline - now
                if remaining < self._fallback_ttl_s / 2:
                    entry.sent_deadline = entry.hold_deadline
                    self._pending.deadlines[entry.request_id] = entry.hold_deadline
        decisions, self._pending = self._pending, Decisions()
        return decisions

    # ---- internals -----------------------------------------------------
    def _confirm(self, entry: RetainedEntry, now: float | None = None) -> None:
        if not entry.released:
            entry.hold_deadline = max(entry.hold_deadline, (now or self._clock()) + self._fallback_ttl_s)

    def _release(self, entry: RetainedEntry, revoke_reason: str | None = None, *, grace: bool = False) -> None:
        if entry.released:
            return
        entry.released = True
        if grace and self._free_grace_s > 0:
            self._draining[entry.request_id] = self._clock() + self._free_grace_s
        else:
            self._pending.release.add(entry.request_id)
        self._pending.deadlines.pop(entry.request_id, None)
        if revoke_reason and entry.lease_id:
            self._pending.revoke.append((entry.lease_id, revoke_reason))

    def _evict(self, free_blocks: int | None, total_blocks: int | None) -> None:
        live = [e for e in self._entries.values() if not e.released]
        live.sort(key=lambda e: e.last_used)
        excess = len(live) - self._max_entries
        deficit = 0
        if free_blocks is not None and total_blocks:
            # Released entries are freed by the worker a step later: count them as free already.
            releasing = sum(e.num_blocks for e in self._entries.values()
                            if e.released and e.request_id not in self._draining)
            deficit = int(self._watermark * total_blocks) - free_blocks - releasing
        # Memory first: ended entries still in their grace go before live ones are evicted.
        while deficit > 0 and self._draining:
            request_id = next(iter(self._draining))
            del self._draining[request_id]
            self._pending.release.add(request_id)
            deficit -= self._entries[request_id].num_blocks
        for entry in live:
            if excess <= 0 and deficit <= 0:
                break
            self._release(entry, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")
            excess -= 1
            deficit -= entry.num_blocks
