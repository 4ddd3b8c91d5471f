"""Read your own turn: an agent whose tool returns in milliseconds sends its next turn before D's connector
has registered the previous one (it registers off the engine's loop, after the request finished) or before
this gateway's own compatibility-mode registration has landed. Looked up at once, that turn misses (or finds
the turn before, a shorter prefix) and recomputes the whole history. So the gateway remembers, per
conversation, the epoch its last turn sent D and when that turn ended, and a lookup waits for that
registration — bounded by ``registration_wait_s`` after the turn ended, so a turn that comes later never
waits, and a registration that never comes costs at most that bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cachetools import LRUCache

from .turn import ConversationId


@dataclass(frozen=True, slots=True)
class FinishedTurn:
    epoch: int  # the epoch the turn sent D (its registration carries it)
    ended_at: float  # monotonic


def registration_wait_s(
    last: FinishedTurn | None, *, registered_epoch: int | None, now: float, max_wait_s: float
) -> float:
    """How long a lookup should wait for the previous turn's registration: 0 when there is no recent turn,
    when its entry (or a newer one) is registered already, or when ``max_wait_s`` since it ended has passed."""
    if last is None or max_wait_s <= 0:
        return 0.0
    if registered_epoch is not None and registered_epoch >= last.epoch:
        return 0.0
    return max(0.0, last.ended_at + max_wait_s - now)


class RecentTurns:
    """The last finished turn of each conversation this gateway served, bounded (least recently used go)."""

    def __init__(self, *, max_conversations: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._turns: LRUCache[ConversationId, FinishedTurn] = LRUCache(maxsize=max_conversations)
        self._clock = clock

    def finished(self, conversation: ConversationId, epoch: int) -> None:
        self._turns[conversation] = FinishedTurn(epoch, self._clock())

    def last(self, conversation: ConversationId) -> FinishedTurn | None:
        return self._turns.get(conversation)

    def now(self) -> float:
        return self._clock()
