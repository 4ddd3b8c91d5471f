"""Exponential backoff: the pauses between the attempts of a retried call, and a retry loop built on them.

Every retrying loop of the SDK, the services and the connector takes its delays from a ``Backoff``;
the loops that only call until success (or a number of attempts) use ``retry``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TypeVar

_T = TypeVar("_T")


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


@dataclass(slots=True)
class Backoff:
    """Delays that start at ``initial_s`` and grow by ``multiplier`` per delay up to ``max_s``; ``reset()``
    starts again from ``initial_s`` (a retried thing that worked again is a fresh outage when it fails next).

    ``jitter`` (0 to 1) spreads each delay uniformly over ``[d * (1 - jitter), d * (1 + jitter)]`` around the
    nominal delay ``d`` (still at most ``max_s``), so that clients that failed together do not retry together.
    ``rand``, ``sleeper`` and ``clock`` are seams for tests (``clock`` is the time deadlines are given in: the
    running event loop's by default).
    """

    initial_s: float
    max_s: float
    _: KW_ONLY
    multiplier: float = 2.0
    jitter: float = 0.0
    rand: Callable[[], float] = random.random
    sleeper: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = _loop_time
    _delay: float = field(init=False)

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < 0:
            raise ValueError("backoff delays must be >= 0")
        if self.multiplier < 1:
            raise ValueError("backoff multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter must be within 0..1")
        self._delay = self.initial_s

    @property
    def upcoming_s(self) -> float:
        """The nominal delay (before jitter) that ``next_delay`` returns next."""
        return min(self._delay, self.max_s)

    def next_delay(self) -> float:
        """The next delay, seconds; the one after it is ``multiplier`` times longer (at most ``max_s``)."""
        delay = self.upcoming_s
        self._delay = min(self._delay * self.multiplier, self.max_s)
        if self.jitter:
            delay = min(delay * (1 - self.jitter + 2 * self.jitter * self.rand()), self.max_s)
        return delay

    def reset(self) -> None:
        """The next delay is ``initial_s`` again."""
        self._delay = self.initial_s

    async def sleep(self, deadline: float | None = None) -> float:
        """Sleeps the next delay, but not past ``deadline`` (in ``clock`` time); returns the seconds slept."""
        delay = self.next_delay()
        if deadline is not None:
            delay = min(delay, max(deadline - self.clock(), 0.0))
        await self.sleeper(delay)
        return delay


async def retry(
    fn: Callable[[], Awaitable[_T]],
    backoff: Backoff,
    *,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    attempts: int | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> _T:
    """Awaits ``fn()`` until it returns, and returns what it returned. A failure of a ``retry_on`` type is
    retried after the backoff's next delay (``on_retry(error, delay)`` hears of it first, to log it) while attempts
    are left (``attempts``: all of them, the first included; None: no limit); any other failure, and the
    last one, is raised."""
    if attempts is not None and attempts < 1:
        raise ValueError("retry needs at least one attempt")
    attempt = 1
    while True:
        try:
            return await fn()
        except retry_on as exc:
            if attempts is not None and attempt >= attempts:
                raise
            delay = backoff.next_delay()
            if on_retry is not None:
                on_retry(exc, delay)
        await backoff.sleeper(delay)
        attempt += 1


__all__ = ["Backoff", "retry"]
