"""Retained KV never delays admission (issue 30 item 7, ADR 0026): the headroom, the withdrawal and retention
decisions as pure functions with typed reasons, and the retention table that applies them (fake clock)."""

from __future__ import annotations

import pytest

from kvbridge_connector.params import ConversationRef
from kvbridge_connector.retention import (
    PeakDemand,
    RetainVerdict,
    RetentionTable,
    WithdrawReason,
    headroom_blocks,
    retention_verdict,
    withdrawal_need,
)

CONV = ConversationRef(tenant="acme", model="tiny", conversation_key="c1", epoch=1)
GRACE = 10.0
HORIZON = 12.0  # grace + one RPC deadline
PRESSURE = "REVOKE_REASON_EVICTED_MEMORY_PRESSURE"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(clock: FakeClock, *, watermark: float = 0.2) -> RetentionTable:
    return RetentionTable(
        clock,
        fallback_ttl_s=100.0,
        max_entries=100,
        free_kv_watermark=watermark,
        free_grace_s=GRACE,
        demand_window_s=30.0,
        horizon_s=HORIZON,
    )


def retain_bound(table: RetentionTable, clock: FakeClock, names: list[str], blocks: int) -> None:
    for lease, name in enumerate(names, start=1):
        table.retain(name, blocks, blocks * 32, CONV)
        table.bind_lease(name, lease)
        clock.now += 0.1


@pytest.mark.parametrize(
    ("peak", "live", "expect"),
    [
        (0, 0, 20),  # no demand seen: the watermark (20 % of 100)
        (30, 20, 20),  # live demand may grow by 10: still the watermark
        (80, 20, 60),  # it reached 80 within the window: 60 more than now
        (150, 20, 100),  # more than the cache: all of it (nothing is retained)
    ],
)
def test_the_headroom_is_what_live_demand_may_grow_to_within_the_window(peak: int, live: int, expect: int) -> None:
    assert headroom_blocks(peak, live, 100, watermark=0.2) == expect


def test_withdrawal_need_counts_blocks_on_their_way_out_and_what_waits() -> None:
    assert withdrawal_need(free_blocks=30, withdrawing_blocks=0, waiting_blocks=0, headroom=20) == 0
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=0, waiting_blocks=0, headroom=20) == 10
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=10, waiting_blocks=0, headroom=20) == 0
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=10, waiting_blocks=30, headroom=20) == 10
    # Once short, a batch more.
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=0, waiting_blocks=0, headroom=20, batch_blocks=10) == 20
    assert withdrawal_need(free_blocks=20, withdrawing_blocks=0, waiting_blocks=0, headroom=20, batch_blocks=10) == 0


@pytest.mark.parametrize(
    ("free", "withdrawing", "waiting", "headroom", "verdict"),
    [
        (40, 0, 0, 20, RetainVerdict.RETAIN),
        (40, 0, 15, 20, RetainVerdict.RETAIN),  # the waiting request fits, and the headroom besides
        (10, 0, 15, 20, RetainVerdict.ADMISSION_WAITING),  # it waits: these blocks are its, now
        (10, 30, 15, 20, RetainVerdict.ADMISSION_WAITING),  # withdrawing blocks come only after a grace
        (15, 0, 0, 20, RetainVerdict.BELOW_HEADROOM),
        (15, 10, 0, 20, RetainVerdict.RETAIN),  # the withdrawals under way restore the headroom
    ],
)
def test_a_finished_request_is_retained_only_from_slack(
    free: int, withdrawing: int, waiting: int, headroom: int, verdict: RetainVerdict
) -> None:
    assert retention_verdict(free, withdrawing, waiting, headroom) is verdict


def test_the_peak_demand_is_a_sliding_window_maximum() -> None:
    clock = FakeClock()
    peak = PeakDemand(clock, window_s=10.0)
    assert peak.peak() == 0
    for blocks in (30, 80, 40):
        peak.sample(blocks)
        clock.now += 1
    assert peak.peak() == 80
    clock.now += 7.5  # 80 was sampled 9.5 s ago
    assert peak.peak() == 80
    clock.now += 0.5
    assert peak.peak() == 40
    clock.now += 10
    assert peak.peak() == 40  # the last sample stands until a new one


def test_live_demand_makes_the_table_withdraw_ahead_of_need_in_one_batch() -> None:
    """Nothing waits and free KV is above the watermark, but live demand reached 60 blocks in the window and
    running requests hold 20 now: the 40 it may grow by must be free or on their way. Every entry that takes
    (plus a batch of 10 % of the cache) is withdrawn at once, and none more while they are on their way out."""
    clock = FakeClock()
    table = make_table(clock)
    table.step(free_blocks=40, total_blocks=100, waiting_blocks=0)  # 60 running, nothing retained: peak 60
    retain_bound(table, clock, [f"e{i}" for i in range(8)], blocks=8)
    # 64 blocks retained, 20 running: 16 free, 40 wanted -> short by 24, +10 -> 34 blocks: five entries.
    first = table.step(free_blocks=16, total_blocks=100)
    assert first.withdrawn == [(f"e{i}", WithdrawReason.HEADROOM) for i in range(5)]
    assert first.revoke == [(lease, PRESSURE) for lease in range(1, 6)] and first.release == set()
    assert table.step(free_blocks=16, total_blocks=100).withdrawn == []  # 16 + 40 on their way cover it
    assert table.verdict(16, 100) is RetainVerdict.RETAIN  # free + withdrawing cover the headroom


def test_a_waiting_request_is_named_as_the_reason_and_nothing_frees_before_the_grace() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.set_connected(True)
    retain_bound(table, clock, ["old", "mid", "new"], blocks=10)
    # A 30-block request waits with 25 free: 5 short, and a batch of 10 more: the two oldest entries.
    decisions = table.step(free_blocks=25, total_blocks=100, waiting_blocks=30)
    assert decisions.withdrawn == [(n, WithdrawReason.ADMISSION_WAITING) for n in ("old", "mid")]
    assert decisions.release == set(), "a READ offered before the revoke may still come"
    for lease in (1, 2):
        table.lease_ended(lease)  # the revokes are confirmed
    clock.now += GRACE - 0.01
    assert table.step(free_blocks=25, total_blocks=100, waiting_blocks=30).release == set()
    clock.now += 0.01
    assert table.step(free_blocks=25, total_blocks=100, waiting_blocks=30).release == {"old", "mid"}


def test_the_table_verdict_counts_its_own_withdrawals_and_what_waits() -> None:
    clock = FakeClock()
    table = make_table(clock)
    assert table.verdict(None, None) is RetainVerdict.RETAIN  # no block pool: stock retention
    retain_bound(table, clock, ["a"], blocks=10)
    assert table.verdict(15, 100) is RetainVerdict.BELOW_HEADROOM  # 15 free, the watermark wants 20
    table.step(free_blocks=15, total_blocks=100)  # withdraws "a": 15 + 10 on the way
    assert table.verdict(15, 100) is RetainVerdict.RETAIN
    assert table.verdict(15, 100, waiting_blocks=16) is RetainVerdict.ADMISSION_WAITING
