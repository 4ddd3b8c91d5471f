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

Retained KV is a cache: it never delays admission (ADR 0026). A withdrawn entry's blocks come back only a
*horizon* after D decides to withdraw it (the revoke's round trip, then ``free_grace_s``), so D keeps a free-block
*headroom* for what live requests (running, and waiting for blocks) may ask for within a horizon: their peak
demand over the last ``demand_window_s`` (at least one horizon) less what they use now, at least the watermark
(``headroom_blocks``). Each step it withdraws, in one batch and ahead of need, every oldest-idle entry it takes
for free + withdrawing blocks to cover that (plus a batch margin, ``withdrawal_need``). And a finished request is
retained only from slack (``retention_verdict``): when a request waits for blocks, or the headroom is not
covered, its blocks are freed at once instead: never registered, never offered, so no grace. A live request
therefore waits at most for the withdrawals of one horizon, never behind one grace after another.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvbridge_connector.params import ConversationRef

Clock = Callable[[], float]

# A withdrawal D asked for (revoke) that is not confirmed yet is asked for again this often.
REVOKE_RETRY_S = 5.0
# Once free + withdrawing blocks fall short of the headroom, D withdraws this fraction of the cache more: one batch
# of revokes (and one grace) for several arrivals, not one entry at each step that falls short.
BATCH_FRACTION = 0.1


class RetainVerdict(enum.StrEnum):
    """Whether a finished request's blocks are retained (an entry) or freed at once, and why."""

    RETAIN = "retain"  # free blocks cover the waiting requests and the headroom without these
    ADMISSION_WAITING = "admission_waiting"  # a request waits for blocks now: these free at once instead
    BELOW_HEADROOM = "below_headroom"  # free + withdrawing blocks are short of the headroom: these free at once


class WithdrawReason(enum.StrEnum):
    """Why D withdraws a live entry itself (the lease is revoked as REVOKE_REASON_EVICTED_MEMORY_PRESSURE)."""

    ENTRY_CAP = "entry_cap"  # more live entries than kvbridge_max_retained_entries
    ADMISSION_WAITING = "admission_waiting"  # requests wait for blocks that free + withdrawing blocks lack
    HEADROOM = "headroom"  # free + withdrawing blocks are short of what live demand may grow to within a horizon


def headroom_blocks(peak_demand_blocks: int, live_blocks: int, total_blocks: int, watermark: float) -> int:
    """The free blocks D keeps ahead of need: what live requests' demand (blocks of running requests plus what
    waiting ones ask for) may grow to within one horizon, i.e. its peak over the demand window, less the blocks
    running requests hold now; at least ``watermark`` of the cache, at most all of it."""
    floor = math.ceil(watermark * total_blocks - 1e-9)  # 0.2 * 100 is 20.000000000000004
    return max(0, min(total_blocks, max(floor, peak_demand_blocks - live_blocks)))


def withdrawal_need(
    free_blocks: int, withdrawing_blocks: int, waiting_blocks: int, headroom: int, batch_blocks: int = 0
) -> int:
    """Blocks of live entries to withdraw now (0: none): free blocks plus those already on their way out must
    cover the headroom and what waiting requests ask for. Once short, D withdraws ``batch_blocks`` more (one
    batch for the next arrivals too, not one entry per step)."""
    short = max(waiting_blocks, headroom) - free_blocks - withdrawing_blocks
    return short + batch_blocks if short > 0 else 0


def retention_verdict(free_blocks: int, withdrawing_blocks: int, waiting_blocks: int, headroom: int) -> RetainVerdict:
    """Whether a finished request may keep its blocks. ``free_blocks`` does not count them (they are still the
    request's). Retained KV only uses slack: a request waiting for blocks gets these at once, and so does the
    headroom when free + withdrawing blocks fall short of it (a withdrawal would free only after its grace)."""
    if waiting_blocks > free_blocks:
        return RetainVerdict.ADMISSION_WAITING
    if withdrawal_need(free_blocks, withdrawing_blocks, waiting_blocks, headroom) > 0:
        return RetainVerdict.BELOW_HEADROOM
    return RetainVerdict.RETAIN


class PeakDemand:
    """The largest live demand (KV blocks) sampled over the last ``window_s``: a sliding-window maximum."""

    def __init__(self, clock: Clock, window_s: float) -> None:
        self._clock = clock
        self._window_s = window_s
        # (time, blocks), blocks strictly decreasing: the front is the window's maximum.
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, blocks: int) -> None:
        now = self._clock()
        while self._samples and self._samples[-1][1] <= blocks:
            self._samples.pop()
        self._samples.append((now, blocks))
        self._trim(now)

    def peak(self) -> int:
        self._trim(self._clock())
        return self._samples[0][1] if self._samples else 0

    def _trim(self, now: float) -> None:
        while len(self._samples) > 1 and self._samples[0][0] <= now - self._window_s:
            self._samples.popleft()


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
    # Live entries D withdrew itself this step, and why (their leases are among ``revoke`` once bound).
    withdrawn: list[tuple[str, WithdrawReason]] = field(default_factory=list)


class RetentionTable:
    def __init__(
        self,
        clock: Clock,
        fallback_ttl_s: float,
        max_entries: int,
        free_kv_watermark: float,
        free_grace_s: float = 0.0,
        *,
        demand_window_s: float = 0.0,
        horizon_s: float | None = None,
    ) -> None:
        self._clock = clock
        self._free_grace_s = free_grace_s
        self._fallback_ttl_s = fallback_ttl_s
        self._max_entries = max_entries
        self._watermark = free_kv_watermark
        # From a withdrawal decision to its blocks being free: the revoke's round trip, then the grace. The demand
        # window covers at least one: the headroom must hold what live requests may ask for before blocks return.
        horizon = free_grace_s + 2.0 if horizon_s is None else horizon_s
        self._demand = PeakDemand(clock, max(demand_window_s, horizon))
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

    def held_blocks(self) -> int:
        """Blocks the table holds: retained entries' and withdrawn ones' not freed yet."""
        return sum(e.num_blocks for e in self._entries.values())

    def headroom(self, free_blocks: int, total_blocks: int, waiting_blocks: int = 0) -> int:
        """The free blocks to keep ahead of need now (``headroom_blocks``); samples the live demand."""
        live = max(0, total_blocks - free_blocks - self.held_blocks())  # running requests' blocks
        self._demand.sample(live + waiting_blocks)
        return headroom_blocks(self._demand.peak(), live, total_blocks, self._watermark)

    def verdict(self, free_blocks: int | None, total_blocks: int | None, waiting_blocks: int = 0) -> RetainVerdict:
        """Whether a finished request may keep its blocks (``retention_verdict``); without a block pool, yes.
        ``free_blocks`` does not count the request's own (they are still allocated to it)."""
        if free_blocks is None or not total_blocks:
            return RetainVerdict.RETAIN
        headroom = self.headroom(free_blocks, total_blocks, waiting_blocks)
        return retention_verdict(free_blocks, self.withdrawn_blocks(), waiting_blocks, headroom)

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

    def registration_failed(self, request_id: str, lease_id: int, withdrawn: bool, *, written: bool = True) -> None:
        """The entry's grant or registration failed. ``withdrawn``: no entry naming these blocks can be in
        the registry (nothing was granted, the registration was refused, or its lease was revoked).
        ``written``: the registry may have stored the entry (False: it refused it, so nothing ever offered it)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if lease_id:
            entry.lease_id = lease_id
            self._by_lease[lease_id] = request_id
        if not withdrawn:
            # Possibly registered: withdraw it like an eviction, free once the lease end is confirmed.
            self._withdraw(entry, "REVOKE_REASON_EXPIRED")
        elif lease_id and written:
            self._ended(entry)  # the lease (and any entry attached to it) ended: the grace covers lookups
        else:
            self._mark_released(entry)
            entry.free_at = self._clock()  # never registered, so never offered: no offer can outlive this

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
    def step(self, free_blocks: int | None, total_blocks: int | None, waiting_blocks: int = 0) -> Decisions:
        """Extend confirmed holds, withdraw under pressure, free what is due; returns the decisions.
        ``waiting_blocks``: what requests the engine could not admit this step asked for."""
        now = self._clock()
        if self._connected:
            for entry in self._entries.values():
                if entry.lease_id and math.isinf(entry.free_at):
                    self._confirm(entry, now)
        self._evict(free_blocks, total_blocks, waiting_blocks)
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

    def _evict(self, free_blocks: int | None, total_blocks: int | None, waiting_blocks: int) -> None:
        """Withdraws, in one batch, the oldest-idle live entries the cap and the free-block need take."""
        live = [e for e in self._entries.values() if not e.released]
        live.sort(key=lambda e: e.last_used)
        excess = len(live) - self._max_entries
        need, reason = 0, WithdrawReason.HEADROOM
        if free_blocks is not None and total_blocks:
            # Withdrawn entries' blocks are on their way out: count them as free already, so pressure
            # withdraws only what it still needs (they cannot be freed sooner: a READ may be under way).
            withdrawing = self.withdrawn_blocks()
            headroom = self.headroom(free_blocks, total_blocks, waiting_blocks)
            batch = math.ceil(total_blocks * BATCH_FRACTION)
            need = withdrawal_need(free_blocks, withdrawing, waiting_blocks, headroom, batch)
            if waiting_blocks > free_blocks:
                reason = WithdrawReason.ADMISSION_WAITING
        for entry in live:
            if excess <= 0 and need <= 0:
                break
            self._withdraw(entry, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")
            self._pending.withdrawn.append((entry.request_id, WithdrawReason.ENTRY_CAP if excess > 0 else reason))
            excess -= 1
            need -= entry.num_blocks
