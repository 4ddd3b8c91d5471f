"""kvbridge.backoff: delays double and cap, reset, jitter bounds, deadline-capped sleeps, and the retry loop.

A fake sleep records the pauses and a fake clock stands for the event loop's, so nothing here sleeps.
"""

from __future__ import annotations

import itertools

import pytest

from kvbridge.backoff import Backoff, retry


class Sleeps:
    def __init__(self) -> None:
        self.slept: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_delays_double_up_to_the_cap() -> None:
    backoff = Backoff(0.1, 1.0)
    assert [backoff.next_delay() for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_multiplier_and_an_initial_delay_above_the_cap() -> None:
    tripling = Backoff(1.0, 10.0, multiplier=3)
    assert [tripling.next_delay() for _ in range(4)] == [1.0, 3.0, 9.0, 10.0]
    assert [Backoff(5.0, 2.0).next_delay() for _ in range(2)] == [2.0, 2.0]
    constant = Backoff(0.5, 0.5)
    assert {constant.next_delay() for _ in range(5)} == {0.5}


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(0.2, 5.0)
    for _ in range(5):
        backoff.next_delay()
    assert backoff.upcoming_s == 5.0
    backoff.reset()
    assert backoff.upcoming_s == 0.2
    assert [backoff.next_delay() for _ in range(3)] == [0.2, 0.4, 0.8]


@pytest.mark.parametrize("draw", [0.0, 0.25, 0.5, 0.999999])
def test_jitter_stays_within_its_spread_and_the_cap(draw: float) -> None:
    backoff = Backoff(0.1, 1.0, jitter=0.5, rand=lambda: draw)
    for nominal in [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]:
        got = backoff.next_delay()
        assert nominal * 0.5 <= got <= min(nominal * 1.5, 1.0)
        assert got == pytest.approx(min(nominal * (0.5 + draw), 1.0))


def test_jitter_does_not_change_the_nominal_schedule() -> None:
    draws = itertools.cycle([0.0, 0.999999])
    backoff = Backoff(0.1, 1.0, jitter=1.0, rand=lambda: next(draws))
    delays = [backoff.next_delay() for _ in range(6)]
    assert delays[0] == 0.0 and delays[2] == 0.0  # full spread: down to nothing
    assert delays[1] == pytest.approx(0.4, rel=1e-5)  # and up to twice the nominal 0.2
    assert delays[5] == 1.0  # capped
    assert backoff.upcoming_s == 1.0


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="delays"):
        Backoff(-1.0, 1.0)
    with pytest.raises(ValueError, match="multiplier"):
        Backoff(0.1, 1.0, multiplier=0.5)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(0.1, 1.0, jitter=1.5)


async def test_sleep_sleeps_the_next_delay_capped_by_the_deadline() -> None:
    sleeps = Sleeps()
    now = 100.0
    backoff = Backoff(0.5, 4.0, sleeper=sleeps, clock=lambda: now)
    assert await backoff.sleep() == 0.5
    assert await backoff.sleep(deadline=now + 10) == 1.0
    assert await backoff.sleep(deadline=now + 0.25) == 0.25  # the deadline comes first
    assert await backoff.sleep(deadline=now - 1) == 0.0  # already past: no pause
    assert sleeps.slept == [0.5, 1.0, 0.25, 0.0]
    assert backoff.upcoming_s == 4.0  # capped sleeps still advanced the schedule


class Script:
    """A call that fails with the scripted errors in turn (a string is returned), counting its calls."""

    def __init__(self, *outcomes: BaseException | str) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def test_retry_returns_after_failures_of_the_retried_kind() -> None:
    sleeps = Sleeps()
    heard: list[tuple[str, float]] = []
    result = await retry(
        Script(OSError("down"), TimeoutError(), "ok"),
        Backoff(0.1, 1.0, sleeper=sleeps),
        retry_on=(OSError, TimeoutError),
        on_retry=lambda exc, delay: heard.append((type(exc).__name__, delay)),
    )
    assert result == "ok"
    assert sleeps.slept == [0.1, 0.2]
    assert heard == [("OSError", 0.1), ("TimeoutError", 0.2)]


async def test_retry_raises_other_failures_at_once() -> None:
    sleeps = Sleeps()
    call = Script(ValueError("not retried"), "ok")
    with pytest.raises(ValueError, match="not retried"):
        await retry(call, Backoff(0.1, 1.0, sleeper=sleeps), retry_on=OSError)
    assert call.calls == 1 and sleeps.slept == []


async def test_retry_raises_the_last_failure_when_attempts_run_out() -> None:
    sleeps = Sleeps()
    call = Script(*(OSError(f"attempt {n}") for n in (1, 2, 3)), "ok")
    with pytest.raises(OSError, match="attempt 3"):
        await retry(call, Backoff(0.5, 0.5, sleeper=sleeps), attempts=3)
    assert call.calls == 3
    assert sleeps.slept == [0.5, 0.5]  # between attempts only, none after the last
    with pytest.raises(ValueError, match="attempt"):
        await retry(call, Backoff(0.5, 0.5, sleeper=sleeps), attempts=0)
