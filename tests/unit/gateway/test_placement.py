"""The placement cost model (gateway/placement.py) and the figures it is fed (gateway/figures.py): every choice
and reason, estimates monotonic in every figure, the load cap and the load terms, the measured figures."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from kvbridge_services.gateway.figures import DecayingFit, Figures
from kvbridge_services.gateway.placement import (
    Choice,
    Costs,
    EngineFigures,
    PlacementInput,
    Why,
    place,
    prefill_seconds,
    transfer_seconds,
)
from kvbridge_services.gateway.reuse import NoReuse, ReuseVerdict
from kvbridge_services.gateway.verdict import ttft_label

DOCS = Path(__file__).resolve().parents[3] / "docs" / "gateway.md"
KIB = 1024
COSTS = Costs(kv_bytes_per_token=128 * KIB, default_bytes_per_s=10e9, pull_fixed_s=0.002, decode_load_weight=0.5)
P = EngineFigures("p0", prefill_s_per_token=1e-4)
D0 = EngineFigures("d0", prefill_s_per_token=1e-4)  # the holder
D1 = EngineFigures("d1", prefill_s_per_token=1e-4)  # the least-loaded other D


def turn(
    n: int = 8000,
    k: int = 7000,
    *,
    p: EngineFigures = P,
    holder: EngineFigures | None = D0,
    least: EngineFigures = D1,
    bw: float | None = None,
) -> PlacementInput:
    links = {} if bw is None else {("p0", "d0"): bw, ("d0", "p0"): bw, ("d1", "p0"): bw}
    return PlacementInput(
        prompt_tokens=n,
        history_tokens=k,
        holder_id="d0" if k else "",
        prefill=p,
        decode=least,
        holder=holder if k else None,
        bytes_per_s=links,
    )


def no_local(costs: Costs = COSTS) -> Costs:
    return dataclasses.replace(costs, local_prefill=False)


# -- every choice and reason ------------------------------------------------------------------------
def test_no_history_recomputes_on_the_least_loaded_d() -> None:
    placed = place(turn(k=0), COSTS)
    assert (placed.choice, placed.reason, placed.chosen.decode) == (Choice.RECOMPUTE, Why.NO_HISTORY, "d1")
    assert placed.chosen.prompt_to_d == 8000 and placed.chosen.history_to_p == 0
    assert placed.label == "recompute;reason=no_history"
    assert placed.estimate(Choice.PULL_TO_P) is None and placed.estimate(Choice.PREFILL_ON_HOLDER) is None


def test_a_long_history_prefills_on_the_holder_with_nothing_moved() -> None:
    placed = place(turn(), COSTS)
    assert (placed.choice, placed.reason, placed.chosen.decode, placed.chosen.prefill) == (
        Choice.PREFILL_ON_HOLDER,
        Why.CHEAPEST,
        "d0",
        None,
    )
    assert placed.chosen.moved_tokens == 0 and placed.chosen.computed == 1000
    assert placed.chosen.ttft_s == pytest.approx(1000 * 1e-4)


def test_without_local_prefill_it_pulls_to_p_and_decodes_on_the_holder_which_pulls_the_suffix() -> None:
    placed = place(turn(), no_local())
    chosen = placed.chosen
    assert (placed.choice, placed.reason, chosen.prefill, chosen.decode) == (Choice.PULL_TO_P, Why.CHEAPEST, "p0", "d0")
    assert (chosen.history_to_p, chosen.prompt_to_d, chosen.computed) == (7000, 1000, 1000)
    pulls = transfer_seconds(7000, 10e9, COSTS) + transfer_seconds(1000, 10e9, COSTS)
    expected = pulls + prefill_seconds(P, 1000, 7000, COSTS)
    assert chosen.ttft_s == pytest.approx(expected)
    assert placed.estimate(Choice.PREFILL_ON_HOLDER) is None


def test_a_slow_link_recomputes_yet_still_decodes_on_the_holder() -> None:
    placed = place(turn(bw=1e8), no_local())  # 100 MB/s: 7000 tokens of history take 9 s to pull
    assert (placed.choice, placed.reason, placed.chosen.decode) == (Choice.RECOMPUTE, Why.CHEAPEST, "d0")
    assert placed.chosen.prompt_to_d == 1000  # the holder still has the history: only the suffix moves


def test_an_unavailable_holder_uses_the_least_loaded_d_and_no_local_prefill() -> None:
    placed = place(turn(holder=None), COSTS)
    assert placed.reason is Why.HOLDER_UNAVAILABLE
    assert {o.decode for o in placed.options} == {"d1"}
    assert placed.estimate(Choice.PREFILL_ON_HOLDER) is None
    assert placed.choice is Choice.PULL_TO_P and placed.chosen.prompt_to_d == 8000  # d1 holds nothing


def test_the_load_cap_sends_the_turn_elsewhere_and_is_the_boundary() -> None:
    within = place(turn(holder=dataclasses.replace(D0, load=4.0, outstanding=0)), COSTS)
    assert within.reason is Why.CHEAPEST and within.chosen.decode == "d0"
    over = place(turn(holder=dataclasses.replace(D0, load=4.5, outstanding=0)), COSTS)
    assert over.reason is Why.HOLDER_OVERLOADED
    assert {o.decode for o in over.options} == {"d1"} and over.estimate(Choice.PREFILL_ON_HOLDER) is None
    assert over.choice is Choice.PULL_TO_P  # the history is still pulled from the overloaded holder


def test_the_holder_being_the_least_loaded_d_is_one_target() -> None:
    placed = place(turn(least=D0), no_local())
    assert {o.decode for o in placed.options} == {"d0"} and len(placed.options) == 2


def test_load_on_the_holder_turns_a_local_prefill_into_a_pull() -> None:
    idle = place(turn(), COSTS)
    busy = place(turn(holder=dataclasses.replace(D0, outstanding=20, load=3.0)), COSTS)
    assert idle.choice is Choice.PREFILL_ON_HOLDER
    assert busy.reason is Why.CHEAPEST and busy.choice is Choice.PULL_TO_P and busy.chosen.decode == "d0"


def test_local_prefills_queued_on_the_holder_count_fully_and_decodes_by_their_weight() -> None:
    costs = dataclasses.replace(COSTS, decode_load_weight=0.05)
    own = prefill_seconds(D0, 1000, 7000, costs)
    decoding = place(turn(holder=dataclasses.replace(D0, outstanding=2)), costs)
    queued = place(turn(holder=dataclasses.replace(D0, outstanding=2, prefilling=2)), costs)
    assert decoding.estimate(Choice.PREFILL_ON_HOLDER) == pytest.approx(1.1 * own)
    assert queued.estimate(Choice.PREFILL_ON_HOLDER) == pytest.approx(3 * own)
    with pytest.raises(ValueError):
        EngineFigures("d0", prefill_s_per_token=1e-4, prefilling=-1)


def test_a_queue_on_p_favours_the_holders_local_prefill() -> None:
    # Short history, where pulling is a close call against a local prefill of a long suffix.
    quiet = place(turn(n=8000, k=1000, holder=dataclasses.replace(D0, outstanding=2, load=2.0)), COSTS)
    queued = place(
        turn(n=8000, k=1000, p=dataclasses.replace(P, outstanding=4), holder=dataclasses.replace(D0, outstanding=2)),
        COSTS,
    )
    assert quiet.choice is Choice.PULL_TO_P
    assert queued.choice is Choice.PREFILL_ON_HOLDER


def test_the_attention_term_makes_long_contexts_pull() -> None:
    linear = no_local()
    quadratic = dataclasses.replace(linear, attention_s_per_token_pair=2e-8)
    slow_link = 128 * KIB / 2e-4  # pulling a token takes twice as long as prefilling it (linearly)
    assert place(turn(n=32000, k=31000, bw=slow_link), linear).choice is Choice.RECOMPUTE
    assert place(turn(n=64, k=48, bw=slow_link), quadratic).choice is Choice.RECOMPUTE
    assert place(turn(n=32000, k=31000, bw=slow_link), quadratic).choice is Choice.PULL_TO_P


def test_equal_estimates_prefer_fewer_tokens_moved() -> None:
    free = dataclasses.replace(COSTS, pull_fixed_s=0.0, default_bytes_per_s=1e13)
    zero = EngineFigures("p0", prefill_s_per_token=0.0)
    placed = place(turn(p=zero, holder=dataclasses.replace(D0, prefill_s_per_token=0.0)), free)
    assert placed.choice is Choice.PREFILL_ON_HOLDER  # all estimates 0: the option that moves nothing


def test_history_is_capped_below_the_prompt() -> None:
    placed = place(turn(n=100, k=500), COSTS)
    assert placed.chosen.computed == 1  # one token is always computed (vLLM needs its logits)


def test_invalid_figures_are_refused() -> None:
    with pytest.raises(ValueError):
        EngineFigures("e", prefill_s_per_token=-1.0)
    with pytest.raises(ValueError):
        Costs(kv_bytes_per_token=0, default_bytes_per_s=1.0)
    with pytest.raises(ValueError):
        dataclasses.replace(COSTS, holder_max_extra_load=-1.0)
    with pytest.raises(ValueError):
        PlacementInput(prompt_tokens=10, history_tokens=5, holder_id="d0", prefill=P, decode=D1, holder=D1)


# -- monotonic in the figures --------------------------------------------------------------------------
def _estimates(
    *,
    s_per_token: float = 1e-4,
    bytes_per_token: float = 128 * KIB,
    bw: float = 10e9,
    fixed: float = 0.002,
    attention: float = 1e-9,
    p_out: float = 1,
    d_out: float = 1,
    d_prefilling: float = 0,
) -> dict[Choice, float | None]:
    costs = Costs(bytes_per_token, bw, pull_fixed_s=fixed, attention_s_per_token_pair=attention)
    p = EngineFigures("p0", prefill_s_per_token=s_per_token, outstanding=int(p_out))
    holder = EngineFigures(
        "d0", prefill_s_per_token=s_per_token, outstanding=int(d_out + d_prefilling), prefilling=int(d_prefilling)
    )
    placed = place(turn(p=p, holder=holder), costs)
    return {c: placed.estimate(c) for c in Choice}


@pytest.mark.parametrize(
    ("figure", "values", "direction"),
    [
        ("s_per_token", (1e-6, 1e-5, 1e-4, 1e-3), +1),
        ("bytes_per_token", (1e3, 1e4, 1e5, 1e6), +1),
        ("bw", (1e8, 1e9, 1e10, 1e11), -1),
        ("fixed", (0.0, 0.001, 0.01, 0.1), +1),
        ("attention", (0.0, 1e-10, 1e-9, 1e-8), +1),
        ("p_out", (0, 1, 4, 16), +1),
        ("d_out", (0, 1, 4, 16), +1),
        ("d_prefilling", (0, 1, 4, 16), +1),
    ],
)
def test_every_estimate_is_monotonic_in_every_figure(figure: str, values: tuple[float, ...], direction: int) -> None:
    series = [_estimates(**{figure: v}) for v in values]
    for choice in Choice:
        times = [s[choice] for s in series]
        assert all(t is not None for t in times)
        for a, b in itertools.pairwise(times):
            assert a is not None and b is not None
            assert (b - a) * direction >= -1e-12, (figure, choice, times)


def test_more_history_never_makes_the_best_estimate_worse() -> None:
    best = [place(turn(n=8000, k=k), COSTS).chosen.ttft_s for k in (0, 1000, 4000, 7000, 7999)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(best))


def test_a_hit_served_in_place_reports_no_pulled_tokens() -> None:
    pulled = ReuseVerdict(outcome=None, tokens=160)
    in_place = ReuseVerdict(outcome=None, tokens=160, in_place=True, placement="prefill_on_holder;reason=cheapest")
    declined = ReuseVerdict(outcome=NoReuse.RECOMPUTE_CHEAPER, tokens=160)
    assert (pulled.pulled_tokens, in_place.pulled_tokens, declined.pulled_tokens) == (160, 0, 0)
    assert in_place.header() == "hit;tokens=160" and declined.header() == "declined:recompute_cheaper;tokens=160"
    assert ttft_label(in_place) == "local" and ttft_label(pulled) == "hit" and ttft_label(declined) == "none"


# -- the measured figures ---------------------------------------------------------------------------------
def test_figures_start_from_the_defaults() -> None:
    f = Figures(prefill_s_per_token=2e-4, pull_bytes_per_s=5e9, kv_bytes_per_token=1000)
    fit = f.prefill("p0")
    assert (fit.fixed_s, fit.s_per_token, fit.samples) == (0.0, 2e-4, 0)
    assert f.bytes_per_s("p0", "d0") == 5e9 and f.measured_bytes_per_s is None
    assert f.pool_prefill(["p0", "p1"]).s_per_token == 2e-4


def test_prefill_fit_recovers_fixed_and_per_token_cost_and_divides_by_the_queue() -> None:
    f = Figures(prefill_s_per_token=1.0, pull_bytes_per_s=1e9, kv_bytes_per_token=1000, weight=0.3)
    for n in (100, 400, 1600, 800, 200, 3200):
        f.observe_prefill("p0", computed=n, context=0, seconds=0.01 + 5e-5 * n, others=0)
        f.observe_prefill("p1", computed=n, context=0, seconds=3 * (0.01 + 5e-5 * n), others=2)  # 2 others queued
    for engine in ("p0", "p1"):
        fit = f.prefill(engine)
        assert fit.fixed_s == pytest.approx(0.01, rel=1e-6) and fit.s_per_token == pytest.approx(5e-5, rel=1e-6)
    assert f.pool_prefill(["p0", "p1", "p9"]).s_per_token == pytest.approx(5e-5, rel=1e-6)


def test_prefill_fit_takes_the_attention_term_out_first() -> None:
    f = Figures(prefill_s_per_token=1.0, pull_bytes_per_s=1e9, kv_bytes_per_token=1000, attention_s_per_token_pair=1e-9)
    for n in (1000, 2000, 4000):
        f.observe_prefill("p0", computed=n, context=0, seconds=1e-4 * n + 1e-9 * n * n / 2, others=0)
    assert f.prefill("p0").s_per_token == pytest.approx(1e-4, rel=1e-6)


def test_equal_sizes_give_a_ratio_and_recent_samples_weigh_most() -> None:
    f = Figures(prefill_s_per_token=1.0, pull_bytes_per_s=1e9, kv_bytes_per_token=1000, weight=0.5)
    for _ in range(5):
        f.observe_prefill("p0", computed=100, context=0, seconds=1.0, others=0)
    fit = f.prefill("p0")
    assert (fit.fixed_s, fit.line) == (0.0, False) and fit.s_per_token == pytest.approx(0.01)
    for _ in range(12):
        f.observe_prefill("p0", computed=100, context=0, seconds=2.0, others=0)  # the engine got slower
    assert f.prefill("p0").s_per_token == pytest.approx(0.02, rel=1e-3)
    with pytest.raises(ValueError):
        DecayingFit(3, 0.0)


def _timed(f: Figures, engine: str, sizes: tuple[int, ...] = (100, 1000, 3000)) -> None:
    """Plain prefills: 0.01 s per call + 1e-4 s per token."""
    for n in sizes:
        f.observe_prefill(engine, computed=n, context=0, seconds=0.01 + 1e-4 * n, others=0)


def test_pull_bandwidth_is_fitted_with_the_per_call_overhead() -> None:
    f = Figures(prefill_s_per_token=1e-4, pull_bytes_per_s=1e9, kv_bytes_per_token=1000, pull_fixed_s=0.001)
    # One pull alone cannot tell the pull from the per-call overhead: no bandwidth yet.
    f.observe_pull("p0", "d0", pulled=4000, computed=500, context=4000, seconds=0.081, others=0)
    assert f.measured_bytes_per_s is None and f.bytes_per_s("p0", "d0") == 1e9
    _timed(f, "p0")
    # 0.01 s per call + 500 new tokens at 1e-4 s + 0.001 s per pull: the rest (0.02 s) moved 4000 x 1000 bytes.
    fit = f.prefill("p0")
    assert fit.line and fit.fixed_s == pytest.approx(0.01) and fit.s_per_token == pytest.approx(1e-4)
    assert f.bytes_per_s("p0", "d0") == pytest.approx(2e8, rel=1e-6)
    assert f.bytes_per_s("d0", "p0") == pytest.approx(2e8, rel=1e-6)  # D's pull from P: the P's figure
    assert f.bytes_per_s("d1", "p1") == pytest.approx(2e8, rel=1e-6)  # every engine's figure
    _timed(f, "p1")
    f.observe_pull("p1", "d1", pulled=4000, computed=500, context=4000, seconds=0.05, others=0)  # faster than
    assert f.prefill("p1").pull_s_per_token is None  # its own prefill estimate: no bandwidth from it


def test_pulls_alone_of_one_prefill_size_still_separate_overhead_prefill_and_pull() -> None:
    f = Figures(prefill_s_per_token=1e-4, pull_bytes_per_s=1e9, kv_bytes_per_token=1000)
    _timed(f, "p0", sizes=(1000, 1000))  # every first turn the same size: no line from plain prefills alone
    assert not f.prefill("p0").line
    for pulled in (1000, 2000, 3000):  # later turns: the same suffix, more history each time
        f.observe_pull("p0", "d0", pulled=pulled, computed=300, context=pulled, seconds=0.04 + 5e-6 * pulled, others=0)
    fit = f.prefill("p0")
    assert fit.line and fit.fixed_s == pytest.approx(0.01) and fit.s_per_token == pytest.approx(1e-4)
    assert f.bytes_per_s("p0", "d0") == pytest.approx(2e8, rel=1e-6)


def test_a_queue_divides_the_prefill_but_not_the_pull() -> None:
    f = Figures(prefill_s_per_token=1e-4, pull_bytes_per_s=1e9, kv_bytes_per_token=1000)
    for n in (100, 1000, 3000):
        f.observe_prefill("p0", computed=n, context=0, seconds=2 * (0.01 + 1e-4 * n), others=1)
    f.observe_pull("p0", "d0", pulled=4000, computed=500, context=4000, seconds=2 * 0.06 + 0.02, others=1)
    assert f.bytes_per_s("p0", "d0") == pytest.approx(2e8, rel=1e-6)


def test_figure_tables_are_bounded() -> None:
    f = Figures(prefill_s_per_token=1e-4, pull_bytes_per_s=1e9, kv_bytes_per_token=1, max_engines=2)
    for e in ("a", "b", "c"):
        _timed(f, e)
    assert f.prefill("a").samples == 0 and f.prefill("c").samples == 3 and f.prefill("c").line


# -- documented ------------------------------------------------------------------------------------------
def test_every_choice_and_reason_is_documented() -> None:
    section = DOCS.read_text().split("## Placement", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))
    assert documented == {c.value for c in Choice} | {w.value for w in Why}
