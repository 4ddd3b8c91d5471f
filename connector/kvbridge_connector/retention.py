"""Decode-side retention table: which finished requests keep their KV blocks, and until when.

Pure bookkeeping (no vLLM, no gRPC) so the scheduler-side rules are unit-testable. The rule they
serve (ARCHITECTURE invariant 6): a NIXL READ is one-sided, D can neither see nor refuse it, so D
frees an entry's blocks only once no prefill can still be reading them.

- A retained entry is *offered* (the registry may name its blocks) from its registration until its
  lease ends. A prefill may start reading up to the engine's offer window after a gateway's lookup,
  and lookups may answer from an index up to ``index_max_lag_s`` behind the store. So D frees a
  *withdrawn* entry's blocks ``free_grace_s`` (>= offer window + index lag + 1 s) after the
  withdrawal is **confirmed** (the lease ended: the lease manager's watch event, a snapshot without
  it, or a revoke the lease manager acknowledged). Never sooner: supersede, close, cap and memory
  pressure included.
- D withdraws an entry itself (memory pressure, entry cap) by revoking its lease; its blocks stay
  until that revoke is confirmed, plus the grace. Memory pressure therefore acts early (the free-KV
  watermark) and counts blocks already on their way out, so it does not evict more than it needs.
- A live entry is held until a *hold deadline*: ``now + fallback_ttl`` at retention, pushed out
  while the control plane confirms the entry's lease (grant, snapshot, renewal, or a connected
  watch stream). When the control plane is unreachable nothing extends it, so the blocks are freed
  ``fallback_ttl`` (>= node lease TTL + grace) after the last confirmation: by then D's node lease,
  which it could not renew either, has ended, and with it every offer of D's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvbridge_connector.params import ConversationRef

Clock = Callable[[], float]

# A withdrawal D asked for (revoke) that is not confirmed yet is asked for again this often.
REVOKE_RETRY_S = 5.0


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
    # Withdrawn: ended or being revoked; never extended again, freed at ``free_at``.
    released: bool = False
    # When the blocks may be freed: +inf until the withdrawal is confirmed.
    free_at: float = math.inf
    # Why D withdrew it (a RevokeReason name) while its revoke is unconfirmed; "" otherwise.
    revoke_reason: str = ""
    revoke_sent_at: float = -math.inf
    # The release decision went out (the entry goes once vLLM or the scheduler reports it freed).
    release_sent: bool = False


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
    def __init__(
        self, clock: Clock, fallback_ttl_s: float, max_entries: int, free_kv_watermark: float, free_grace_s: float = 0.0
    ) -> None:
        self._clock = clock
        self._free_grace_s = free_grace_s
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

    def withdrawn_blocks(self) -> int:
        """Blocks of withdrawn entries not freed yet (they are on their way out)."""
        return sum(e.num_blocks for e in self._entries.values() if e.released)

    # ---- events --------------------------------------------------------
    def retain(self, request_id: str, num_blocks: int, token_count: int, conversation: ConversationRef | None) -> float:
        """Start holding a finished request's blocks; returns the first hold deadline."""
        now = self._clock()
        deadline = now + self._fallback_ttl_s
        self._entries[request_id] = RetainedEntry(
            request_id,
            num_blocks,
            token_count,
            conversation,
            deadline,
            now,
            sent_deadline=deadline,
        )
        return deadline

    def set_connected(self, connected: bool) -> None:
        self._connected = connected

    def bind_lease(self, request_id: str, lease_id: int) -> None:
        """The entry's lease was granted and the entry registered."""
        entry = self._entries.get(request_id)
        if entry is None:
            # Freed while the grant was in flight (only after the fallback TTL): the lease must not
            # outlive the blocks.
            self._pending.revoke.append((lease_id, "REVOKE_REASON_EXPIRED"))
            return
        entry.lease_id = lease_id
        self._by_lease[lease_id] = request_id
        if lease_id in self._ended_leases:
            self._ended(entry)
        elif entry.released:
            # Withdrawn while its registration was in flight: revoke now, free once that is confirmed.
            self._request_revoke(entry, entry.revoke_reason or "REVOKE_REASON_EXPIRED")
        else:
            self._confirm(entry)

    def registration_failed(self, request_id: str, lease_id: int, withdrawn: bool) -> None:
        """The entry's grant or registration failed. ``withdrawn``: no entry naming these blocks can be in
        the registry (nothing was granted, the registration was refused, or its lease was revoked)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if lease_id:
            entry.lease_id = lease_id
            self._by_lease[lease_id] = request_id
        if not withdrawn:
            # Possibly registered: withdraw it like an eviction, free once the lease end is confirmed.
            self._withdraw(entry, "REVOKE_REASON_EXPIRED")
        elif lease_id:
            self._ended(entry)  # the lease (and any entry attached to it) ended: the grace covers lookups
        else:
            self._mark_released(entry)
            entry.free_at = self._clock()  # never registered, so never offered

    def lease_alive(self, lease_id: int) -> None:
        """ACTIVE or RENEWED: a renewal also marks the entry as recently used."""
        request_id = self._by_lease.get(lease_id)
        if request_id is not None:
            entry = self._entries[request_id]
            entry.last_used = self._clock()
            self._confirm(entry)

    def lease_ended(self, lease_id: int) -> None:
        """The lease manager ended the lease (watch event, or a revoke it acknowledged)."""
        request_id = self._by_lease.get(lease_id)
        if request_id is None:
            self._ended_leases[lease_id] = None
            while len(self._ended_leases) > 4 * self._max_entries:
                del self._ended_leases[next(iter(self._ended_leases))]
            return
        self._ended(self._entries[request_id])

    def snapshot(self, live_lease_ids: Iterable[int]) -> None:
        """A (re)connected watch listed every live lease: what is not in it has ended."""
        live = set(live_lease_ids)
        for entry in list(self._entries.values()):
            if not entry.lease_id:
                continue
            if entry.lease_id not in live:
                self._ended(entry)
            elif not entry.released:
                self._confirm(entry)

    def freed(self, request_id: str) -> None:
        """vLLM freed the blocks (finished sending): forget the entry."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry.lease_id:
            self._by_lease.pop(entry.lease_id, None)
            if math.isinf(entry.free_at):
                # Freed by the fallback deadline while the lease may still live: end it.
                self._pending.revoke.append((entry.lease_id, "REVOKE_REASON_EXPIRED"))

    # ---- per step ------------------------------------------------------
    def step(self, free_blocks: int | None, total_blocks: int | None) -> Decisions:
        """Extend confirmed holds, withdraw under pressure, free what is due; returns the decisions."""
        now = self._clock()
        if self._connected:
            for entry in self._entries.values():
                if entry.lease_id and math.isinf(entry.free_at):
                    self._confirm(entry, now)
        self._evict(free_blocks, total_blocks)
        for entry in self._entries.values():
            if entry.released:
                if entry.free_at <= now:
                    if not entry.release_sent:
                        entry.release_sent = True
                        self._pending.release.add(entry.request_id)
                elif entry.revoke_reason and entry.lease_id and now - entry.revoke_sent_at >= REVOKE_RETRY_S:
                    self._request_revoke(entry, entry.revoke_reason, now)
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
        """The control plane vouches for the entry: hold on (a withdrawn one until its end is confirmed)."""
        if math.isinf(entry.free_at):
            entry.hold_deadline = max(entry.hold_deadline, (now or self._clock()) + self._fallback_ttl_s)

    def _mark_released(self, entry: RetainedEntry) -> None:
        entry.released = True
        self._pending.deadlines.pop(entry.request_id, None)

    def _ended(self, entry: RetainedEntry) -> None:
        """The entry's lease ended (confirmed): no new offer names its blocks once the indexes catch up."""
        self._mark_released(entry)
        entry.revoke_reason = ""
        entry.free_at = min(entry.free_at, self._clock() + self._free_grace_s)

    def _withdraw(self, entry: RetainedEntry, revoke_reason: str) -> None:
        """D withdraws the entry itself: revoke its lease; the blocks stay until the end is confirmed."""
        if entry.released:
            return
        self._mark_released(entry)
        entry.revoke_reason = revoke_reason
        if entry.lease_id:
            self._request_revoke(entry, revoke_reason)
        # No lease yet (registration in flight): bind_lease or registration_failed completes it.

    def _request_revoke(self, entry: RetainedEntry, reason: str, now: float | None = None) -> None:
        entry.revoke_reason = reason
        entry.revoke_sent_at = self._clock() if now is None else now
        self._pending.revoke.append((entry.lease_id, reason))

    def _evict(self, free_blocks: int | None, total_blocks: int | None) -> None:
        live = [e for e in self._entries.values() if not e.released]
        live.sort(key=lambda e: e.last_used)
        excess = len(live) - self._max_entries
        deficit = 0
        if free_blocks is not None and total_blocks:
            # Withdrawn entries' blocks are on their way out: count them as free already, so pressure
            # withdraws only what it still needs (they cannot be freed sooner: a READ may be under way).
            deficit = int(self._watermark * total_blocks) - free_blocks - self.withdrawn_blocks()
        for entry in live:
            if excess <= 0 and deficit <= 0:
                break
            self._withdraw(entry, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")
            excess -= 1
            deficit -= entry.num_blocks
