"""What one turn carries between its steps: the plan made before prefill, and the result the front doors serve."""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import reuse
from .engines import EngineState
from .placement import Placement
from .reuse import NoReuse, ReusePlan, ReuseVerdict
from .threads import Thread


@dataclass(slots=True)
class TurnResult:
    verdict: ReuseVerdict
    # Non-streaming: D's response (internal fields removed). Streaming: D's SSE bytes as they arrive.
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    after: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        """Starts the post-turn work (the renewal's write, compatibility-mode registration, the turn's log line).
        Front doors call it once the client has its answer (or the stream ended), so none of that work
        runs between D's answer and the client's."""
        after, self.after = self.after, []
        for step in after:
            step()


class PullOutcome(enum.Enum):
    """What P did with an offer of D's blocks: an observation of the prefill step (verdict.py judges it)."""

    RECOMPUTED = "recomputed"  # P answered having read nothing (remote_prefill_cached_tokens 0)
    TIMED_OUT = "timed_out"
    FAILED = "failed"


@dataclass(slots=True)
class Observed:
    """What the turn's engine steps saw, each field written by one step: facts, not verdicts."""

    pull: PullOutcome | None = None  # prefill.py, when P was offered D's blocks
    local_prefill_failed: bool = False  # the router, when the holder D failed a local prefill
    engine_prompt_tokens: int = 0  # prefill.py: P's usage.prompt_tokens (a turn planned without its ids)


@dataclass(slots=True)
class TurnPlan:
    """What the turn decided before prefill, what its engine steps observed, and the timings they add. The
    verdict the client sees is made from it by one pure function (``verdict.verdict_of``)."""

    prompt_ids: Sequence[int] | None = None  # a list, or the tokenizer's array("I")
    block_size: int = 16
    # The reuse decision: None when a pull or a local prefill is planned, else why not; the tokens it verified
    # (a hit: those P pulls, or the holder's prefix cache serves); whether it is served in place.
    outcome: NoReuse | None = NoReuse.NOT_REQUESTED
    reused_tokens: int = 0
    in_place: bool = False
    prompt_tokens: int = 0  # the prompt's ids, when the turn computed them
    observed: Observed = field(default_factory=Observed)
    features: reuse.RequestFeatures = field(default_factory=reuse.RequestFeatures)
    pull: ReusePlan | None = None  # what P pulls (a hit), single-use entries already consumed
    # Placement on: the cost model's choice, and the decode engine it chose (None: the pool's least-loaded D).
    placement: Placement | None = None
    decode_engine: EngineState | None = None
    next_epoch: int | None = None
    verified_tokens: int = 0  # what the registry verified (before flooring / declining)
    started: float = field(default_factory=time.perf_counter)
    engine_seconds: float = 0.0  # time inside prefill calls (excluded from router overhead)
    decode_sent_s: float = 0.0  # wall time the decode request went out / its response came back
    decode_answered_s: float = 0.0
    sent_epoch: int = 0  # the epoch sent to D with the decode request (0: not sent yet)
    connector_registers: bool = False  # D runs the kvbridge connector: it registers the turn's state itself
    # A new conversation's first turn, planned without its ids (nothing to look up): they are computed while D
    # decodes, so that the next turn encodes and hashes only what it appends.
    warm_up: bool = False
    # A keyless turn's thread (threads.py): the key it registers under, and whether it continues or forks one.
    thread: Thread | None = None

    @property
    def epoch(self) -> int:
        """The epoch this turn's new state registers under: microseconds of wall time, and above the one
        the lookup saw.

        Time-based epochs order a conversation's turns across gateway replicas and across a registration
        that lands after the next turn's lookup (reading the stored epoch and adding one would let an older
        turn's state supersede a newer one).
        """
        return max(self.next_epoch or 0, time.time_ns() // 1_000)
