"""The turn's verdict (verdict.py): one pure function of the decision and what the engine steps observed."""

from __future__ import annotations

import pytest

from kvbridge_services.gateway.placement import Choice, Costs, EngineFigures, PlacementInput, place
from kvbridge_services.gateway.reuse import NoReuse
from kvbridge_services.gateway.turnstate import PullOutcome, TurnPlan
from kvbridge_services.gateway.verdict import ttft_label, verdict_of


def _planned_pull(tokens: int = 160) -> TurnPlan:
    plan = TurnPlan()
    plan.outcome, plan.reused_tokens, plan.prompt_tokens = None, tokens, 200
    return plan


def test_a_turn_that_decided_nothing_is_not_requested() -> None:
    verdict = verdict_of(TurnPlan())
    assert verdict.header() == "miss;tokens=0" and verdict.outcome is NoReuse.NOT_REQUESTED
    assert ttft_label(verdict) == "none"


def test_a_planned_pull_that_p_carried_out_is_a_hit_with_its_tokens() -> None:
    verdict = verdict_of(_planned_pull())
    assert verdict.header() == "hit;tokens=160" and verdict.pulled_tokens == 160 and verdict.prompt_tokens == 200
    assert ttft_label(verdict) == "hit"


@pytest.mark.parametrize(
    ("seen", "outcome"),
    [
        (PullOutcome.RECOMPUTED, NoReuse.RECOMPUTED),
        (PullOutcome.TIMED_OUT, NoReuse.PREFILL_TIMEOUT),
        (PullOutcome.FAILED, NoReuse.PREFILL_FAILED),
    ],
)
def test_what_p_did_with_the_offer_overrides_the_planned_hit(seen: PullOutcome, outcome: NoReuse) -> None:
    plan = _planned_pull()
    plan.observed.pull = seen
    verdict = verdict_of(plan)
    assert verdict.outcome is outcome and verdict.pulled_tokens == 0
    assert verdict.tokens == 160  # what was verified stays in the header
    assert ttft_label(verdict) == "none"


def test_a_local_prefill_that_failed_is_no_longer_in_place() -> None:
    plan = _planned_pull()
    plan.in_place = True
    assert ttft_label(verdict_of(plan)) == "local" and verdict_of(plan).pulled_tokens == 0
    plan.observed.local_prefill_failed = True
    verdict = verdict_of(plan)
    assert verdict.outcome is NoReuse.LOCAL_PREFILL_FAILED and not verdict.in_place


def test_the_prompt_size_is_the_turns_own_count_else_ps() -> None:
    plan = TurnPlan()
    plan.observed.engine_prompt_tokens = 321  # a new conversation planned without its ids
    assert verdict_of(plan).prompt_tokens == 321
    plan.prompt_tokens = 300
    assert verdict_of(plan).prompt_tokens == 300


def test_the_placement_label_comes_from_the_plans_placement() -> None:
    plan = _planned_pull()
    assert verdict_of(plan).placement == ""
    p, d = EngineFigures("p0", prefill_s_per_token=1e-4), EngineFigures("d0", prefill_s_per_token=1e-4)
    chosen = place(
        PlacementInput(prompt_tokens=8000, history_tokens=0, holder_id="", prefill=p, decode=d, holder=None),
        Costs(kv_bytes_per_token=1024, default_bytes_per_s=10e9),
    )
    plan.placement = chosen
    assert verdict_of(plan).placement == chosen.label == f"{Choice.RECOMPUTE.value};reason={chosen.reason.value}"
