"""Where a turn runs when placement is on (KVBRIDGE_GATEWAY_PLACEMENT, ADR 0020): the cost model's inputs
gathered from the pool and the measured figures, and what a choice records. The choice itself is the pure
:func:`placement.place`; whether a pull is safe at all stays :func:`reuse.decide`'s alone."""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry import trace

from . import placement
from .engines import DECODE, PREFILL, EnginePool, EngineState
from .figures import Figures, PrefillFit
from .metrics import GatewayMetrics, engine_label
from .placement import Choice, EngineFigures, Placement, PlacementInput
from .reuse import ReusePlan
from .turn import Turn
from .turnstate import TurnPlan


class Placer:
    def __init__(
        self,
        costs: placement.Costs,
        figures: Figures,
        pool: EnginePool,
        metrics: GatewayMetrics,
        *,
        shares_turn: Callable[[Turn, EngineState], bool],
    ) -> None:
        """``shares_turn(turn, engine)``: whether the engine's KV is this turn's kind of KV (not a LoRA adapter's,
        the same deployment secret): only then may it serve as the holder."""
        self._costs = costs
        self._figures = figures
        self._pool = pool
        self._metrics = metrics
        self._shares_turn = shares_turn

    def place(
        self, turn: Turn, plan: TurnPlan, decided: ReusePlan | None, prefill: EngineState, decode: EngineState
    ) -> tuple[Placement, EngineState]:
        """The cost model's choice for this turn and the decode engine it names (``decided``: the reuse decision's
        plan, None when there is no history to reuse). Figures: P's measured prefill line; a decode engine's
        local prefill at the mean of the measured P lines (D's prefills are not timed: they share the call with
        the decode); loads from the pool."""
        p_key, d_key = engine_key(prefill), engine_key(decode)
        d_fit = self._figures.pool_prefill(
            [engine_key(e) for e in self._pool.all() if e.role == PREFILL and e.serves(turn.model)]
        )
        holder_id = decided.source.engine_id if decided is not None else ""
        holder = self._eligible_holder(turn, holder_id) if holder_id else None
        links = {(p_key, holder_id): self._figures.bytes_per_s(p_key, holder_id)} if holder_id else {}
        for d in {d_key, holder_id} - {""}:
            links[(d, p_key)] = self._figures.bytes_per_s(d, p_key)
        placed = placement.place(
            PlacementInput(
                prompt_tokens=plan.prompt_tokens,
                history_tokens=decided.tokens if decided is not None else 0,
                holder_id=holder_id,
                prefill=self._engine_figures(prefill, self._figures.prefill(p_key)),
                decode=self._engine_figures(decode, d_fit),
                holder=self._engine_figures(holder, d_fit) if holder is not None else None,
                bytes_per_s=links,
            ),
            self._costs,
        )
        on_holder = holder is not None and placed.chosen.decode == holder_id
        return placed, holder if on_holder and holder is not None else decode

    def _engine_figures(self, engine: EngineState, fit: PrefillFit) -> EngineFigures:
        return EngineFigures(
            engine_id=engine_key(engine),
            prefill_s_per_token=fit.s_per_token,
            prefill_fixed_s=fit.fixed_s,
            load=self._pool.load(engine),
            outstanding=engine.outstanding,
            prefilling=engine.prefilling,
        )

    def _eligible_holder(self, turn: Turn, engine_id: str) -> EngineState | None:
        """The holder as a decode target: a healthy, not ejected decode engine of this pool that serves the model,
        shares this gateway's secret and is not waiting for a new incarnation; None otherwise."""
        engine = self._pool.find_role(engine_id, DECODE)
        if engine is None or not engine.offers_blocks or not engine.serves(turn.model):
            return None
        if engine.ejected(time.monotonic()) or not self._shares_turn(turn, engine):
            return None
        return engine

    def record(self, span: trace.Span, placed: Placement, pulled: int, prefill: EngineState | None) -> None:
        """The choice on the turn's span (every option's estimate) and in the metrics, with the figures."""
        chosen = placed.chosen
        attrs: dict[str, str | float] = {
            "kvbridge.placement": chosen.choice.value,
            "kvbridge.placement.reason": placed.reason.value,
        }
        for choice in Choice:
            estimate = placed.estimate(choice)
            if estimate is not None:
                attrs[f"kvbridge.placement.ttft_estimate_s.{choice.value}"] = round(estimate, 6)
        span.set_attributes(attrs)
        m = self._metrics
        m.placement.labels(chosen.choice.value, placed.reason.value).inc()
        m.moved_tokens.labels("history_to_p").inc(pulled)
        m.moved_tokens.labels("prompt_to_d").inc(chosen.prompt_to_d)
        if prefill is not None:
            key = engine_key(prefill)
            m.prefill_s_per_token.labels(engine_label(prefill.engine_id, prefill.url)).set(
                self._figures.prefill(key).s_per_token
            )
        measured = self._figures.measured_bytes_per_s
        if measured is not None:
            m.pull_bytes_per_s.set(measured)


def set_placement(plan: TurnPlan, placed: tuple[Placement, EngineState]) -> None:
    plan.placement, plan.decode_engine = placed


def recompute_instead(plan: TurnPlan) -> None:
    """The pull the placement chose cannot happen (the entry was consumed, the consume failed): the turn
    recomputes on the same D, recorded as that option."""
    placed = plan.placement
    if placed is None:
        return
    same_d = [o for o in placed.options if o.choice is Choice.RECOMPUTE and o.decode == placed.chosen.decode]
    if same_d:
        plan.placement = Placement(same_d[0], placed.reason, placed.options)


def engine_key(engine: EngineState) -> str:
    """How the placement and its figures name an engine: its registry id, else its URL."""
    return engine.engine_id or engine.url
