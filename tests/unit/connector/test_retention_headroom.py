"""Retained KV never delays admission (issue 30 item 7, ADR 0026): the headroom, the withdrawal and retention
decisions as pure functions with typed reasons, and the retention table that applies them (fake clock)."""

from __future__ import annotations

import pytest

from kvbridge_connector.params import ConversationRef
from kvbridge_connector.retention import (
    ArrivalRate,
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


def make_table(clock: FakeClock, *, watermark: float = 0.2, max_fraction: float = 0.5) -> RetentionTable:
    return RetentionTable(
        clock,
        fallback_ttl_s=100.0,
        max_entries=100,
        free_kv_watermark=watermark,
        free_grace_s=GRACE,
        headroom_max_fraction=max_fraction,
        arrival_window_s=30.0,
        horizon_s=HORIZON,
    )


def retain_bound(table: RetentionTable, clock: FakeClock, names: list[str], blocks: int) -> None:
    for lease, name in enumerate(names, start=1):
        table.retain(name, blocks, blocks * 32, CONV)
        table.bind_lease(name, lease)
        clock.now += 0.1


@pytest.mark.parametrize(
    ("rate", "expect"),
    [
        (0.0, 20),  # no arrivals: the watermark (20 % of 100)
        (1.0, 20),  # 12 blocks within a horizon: still the watermark
        (3.0, 36),  # 36 blocks arrive within a horizon
        (10.0, 50),  # capped at half the cache
    ],
)
def test_the_headroom_is_the_arrivals_of_one_horizon_between_the_watermark_and_the_cap(
    rate: float, expect: int
) -> None:
    assert headroom_blocks(rate, HORIZON, 100, watermark=0.2, max_fraction=0.5) == expect


def test_a_cap_below_the_watermark_leaves_the_watermark() -> None:
    assert headroom_blocks(10.0, HORIZON, 100, watermark=0.3, max_fraction=0.1) == 30


def test_withdrawal_need_counts_blocks_on_their_way_out_and_what_waits() -> None:
    assert withdrawal_need(free_blocks=30, withdrawing_blocks=0, waiting_blocks=0, headroom=20) == 0
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=0, waiting_blocks=0, headroom=20) == 10
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=10, waiting_blocks=0, headroom=20) == 0
    assert withdrawal_need(free_blocks=10, withdrawing_blocks=10, waiting_blocks=15, headroom=20) == 15


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


def test_the_arrival_rate_counts_each_request_once_over_its_window() -> None:
    clock = FakeClock()
    rate = ArrivalRate(clock, window_s=10.0)
    assert rate.blocks_per_s() == 0.0
    rate.note("a", 20)
    rate.note("a", 20)  # vLLM asks again while the request waits
    rate.note("b", 10)
    assert rate.blocks_per_s() == pytest.approx(3.0)
    clock.now += 10.0
    assert rate.blocks_per_s() == 0.0


def test_arrivals_make_the_table_withdraw_ahead_of_need_in_one_batch() -> None:
    """Nothing waits yet and free KV is above the watermark, but the arrivals of one horizon would not fit:
    every entry that takes is withdrawn at once (one batch), and none more while they are on their way out."""
    clock = FakeClock()
    table = make_table(clock)
    retain_bound(table, clock, [f"e{i}" for i in range(8)], blocks=8)
    for i in range(30):  # 3 blocks/s over the 30 s window: 36 blocks within a horizon
        table.note_arrival(f"r{i}", 3)
    assert table.headroom(100) == 36
    first = table.step(free_blocks=25, total_blocks=100)  # above the 20 % watermark, short of 36
    assert first.withdrawn == [("e0", WithdrawReason.HEADROOM), ("e1", WithdrawReason.HEADROOM)]
    assert first.revoke == [(1, PRESSURE), (2, PRESSURE)] and first.release == set()
    assert table.step(free_blocks=25, total_blocks=100).withdrawn == []  # 25 + 16 on their way cover it


def test_a_waiting_request_is_named_as_the_reason_and_nothing_frees_before_the_grace() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.set_connected(True)
    retain_bound(table, clock, ["old", "mid", "new"], blocks=10)
    decisions = table.step(free_blocks=25, total_blocks=100, waiting_blocks=30)  # needs 30 + 20, has 25
    assert decisions.withdrawn == [(n, WithdrawReason.ADMISSION_WAITING) for n in ("old", "mid", "new")]
    assert decisions.release == set(), "a READ offered before the revoke may still come"
    for lease in (1, 2, 3):
        table.lease_ended(lease)  # the revokes are confirmed
    clock.now += GRACE - 0.01
    assert table.step(free_blocks=25, total_blocks=100, waiting_blocks=30).release == set()
    clock.now += 0.01
    assert table.step(free_blocks=25, total_blocks=100, waiting_blocks=30).release == {"old", "mid", "new"}


def test_the_table_verdict_counts_its_own_withdrawals() -> None:
    clock = FakeClock()
    table = make_table(clock)
    assert table.verdict(None, None) is RetainVerdict.RETAIN  # no block pool: stock retention
    retain_bound(table, clock, ["a"], blocks=10)
    assert table.verdict(15, 100) is RetainVerdict.BELOW_HEADROOM
    table.step(free_blocks=15, total_blocks=100)  # withdraws "a": 15 + 10 on the way
    assert table.verdict(15, 100) is RetainVerdict.RETAIN
    assert table.verdict(15, 100, waiting_blocks=16) is RetainVerdict.ADMISSION_WAITING
