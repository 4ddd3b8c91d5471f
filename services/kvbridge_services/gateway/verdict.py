"""The turn's verdict (the ``x-kvbridge-reuse`` header, the reuse metrics, the turn span's attributes): one pure
function of what the turn decided and what its engine steps observed. Its only writer: the steps record facts
(``TurnPlan.observed``), the router's decision stages record the decision (``TurnPlan.outcome`` and its tokens),
and nothing else assigns a verdict."""

from __future__ import annotations

from .reuse import NoReuse, ReuseVerdict
from .turnstate import PullOutcome, TurnPlan

_PULL_OUTCOMES = {
    PullOutcome.RECOMPUTED: NoReuse.RECOMPUTED,
    PullOutcome.TIMED_OUT: NoReuse.PREFILL_TIMEOUT,
    PullOutcome.FAILED: NoReuse.PREFILL_FAILED,
}


def verdict_of(plan: TurnPlan) -> ReuseVerdict:
    """A failed local prefill on the holder, then what P did with an offer, override the decision's outcome (the
    decision's tokens stay: they say what was verified); the prompt's size is the turn's own count, else P's."""
    seen = plan.observed
    outcome, in_place = plan.outcome, plan.in_place
    if seen.local_prefill_failed:
        outcome, in_place = NoReuse.LOCAL_PREFILL_FAILED, False
    elif seen.pull is not None:
        outcome = _PULL_OUTCOMES[seen.pull]
    return ReuseVerdict(
        outcome=outcome,
        tokens=plan.reused_tokens,
        prompt_tokens=plan.prompt_tokens or seen.engine_prompt_tokens,
        in_place=in_place,
        placement=plan.placement.label if plan.placement is not None else "",
    )


def ttft_label(verdict: ReuseVerdict) -> str:
    """The TTFT metric's label: hit (P pulled), local (the holder's prefix cache served it), none."""
    if not verdict.hit:
        return "none"
    return "local" if verdict.in_place else "hit"
