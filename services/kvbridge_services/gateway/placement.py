"""Where a turn runs: the cost model that picks, per turn, among three ways to serve a conversation's history.

1. ``RECOMPUTE``: a plain prefill of the whole prompt on P; D pulls P's KV (only the part it does not hold).
2. ``PULL_TO_P``: P pulls the verified history from the D that holds it, prefills the new suffix, then D pulls
   P's KV (again only the part D does not hold).
3. ``PREFILL_ON_HOLDER``: the turn goes straight to the D that holds the history as a plain (non-disaggregated)
   request: D's own prefix cache serves the history, D prefills the suffix and decodes. No P, no transfer.

vLLM's D counts its local prefix-cache hits before it asks the NIXL connector for the rest, and the connector's
worker reads only the tail of P's blocks that D does not already hold (docs/gateway.md, "Placement"): so a D
that holds the conversation pulls only the new suffix in options 1 and 2 as well. Hence D is the holder unless
its load exceeds the least-loaded D's by more than the cap (``Costs.holder_max_extra_load``).

One pure function, :func:`place`: from the turn's token counts, the holder, the engines' measured figures
(prefill seconds per token, pull bandwidth, load) and the configured costs it returns every option it
considered with its estimated time to first token, the cheapest, and why. It does no I/O and never decides
*whether* a pull is safe: :func:`kvbridge_services.gateway.reuse.decide` does, and only a turn it gave a plan
(``history_tokens`` > 0) is offered options 2 and 3.

The estimates (seconds, up to the first decode step, which every option shares):

* prefill of ``n`` new tokens after ``c`` cached ones on engine ``e``:
  ``fixed_e + a_e * n + attention * n * (c + n / 2)``
* a transfer of ``t`` tokens over a link of ``bw`` bytes/s: ``pull_fixed + t * kv_bytes_per_token / bw``
* P's queue: its prefills are compute-bound and share it, so with ``k`` other prefills in flight a prefill takes
  ``(1 + k)`` times its own work.
* D's local prefill waits for the local prefills this gateway already runs there (each as long as its own, the
  same queue model as P's) and competes with D's decodes: ``(1 + prefilling_D + decode_load_weight *
  decodes_D)`` times its own work.

RECOMPUTE = P queue x prefill(N, 0) + transfer(N - cached_D);
PULL_TO_P = transfer(K) + P queue x prefill(N - K, K) + transfer(N - cached_D);
PREFILL_ON_HOLDER = D queue and load x prefill_D(N - K, K); ``cached_D`` is K on the holder, 0 elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Choice",
    "Costs",
    "EngineFigures",
    "Option",
    "Placement",
    "PlacementInput",
    "Why",
    "place",
    "prefill_seconds",
    "transfer_seconds",
]


class Choice(enum.StrEnum):
    """How the turn is served (the ``x-kvbridge-placement`` header's first part, the metric's ``choice``)."""

    RECOMPUTE = "recompute"  # plain prefill on P, D pulls P's KV
    PULL_TO_P = "pull_to_p"  # P pulls the history from the holder D, prefills the suffix, D pulls P's KV
    PREFILL_ON_HOLDER = "prefill_on_holder"  # the holder D prefills the suffix itself and decodes: no P


class Why(enum.StrEnum):
    """Why the choice (docs/gateway.md, "Placement", documents every member)."""

    CHEAPEST = "cheapest"  # the lowest estimated TTFT among the options the holder's state allows
    NO_HISTORY = "no_history"  # no verified history this turn may reuse: recompute on the least-loaded D
    HOLDER_UNAVAILABLE = "holder_unavailable"  # the holder is not a healthy decode engine of this pool
    HOLDER_OVERLOADED = "holder_overloaded"  # the holder's load exceeds the least-loaded D's by more than the cap


# Tie-break of equal estimates: fewer tokens moved first, then this order (local before pull before recompute).
_RANK = {Choice.PREFILL_ON_HOLDER: 0, Choice.PULL_TO_P: 1, Choice.RECOMPUTE: 2}


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """One engine as the gateway measures it."""

    engine_id: str
    prefill_s_per_token: float  # measured (a decaying fit of this engine's prefill calls) or the default
    prefill_fixed_s: float = 0.0  # per-call time that does not grow with tokens (HTTP, scheduling)
    load: float = 0.0  # the pool's load score (outstanding + kv_usage_weight x KV usage): the holder cap compares it
    outstanding: int = 0  # this gateway's requests in flight on it: the queue terms use it
    prefilling: int = 0  # of those, local prefills (a decode engine's plain requests): the rest are decodes

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.prefill_fixed_s < 0 or self.outstanding < 0 or self.prefilling < 0:
            raise ValueError("engine figures must not be negative")

    @property
    def decodes(self) -> int:
        return max(0, self.outstanding - self.prefilling)


@dataclass(frozen=True, slots=True)
class Costs:
    """The configured part of the model (gateway settings ``placement_*``)."""

    kv_bytes_per_token: float  # KV bytes one token occupies (all layers, K and V): what a transfer moves
    default_bytes_per_s: float  # pull bandwidth of a link not measured yet
    attention_s_per_token_pair: float = 0.0  # quadratic (attention) prefill term per new token per context token
    pull_fixed_s: float = 0.0  # per-transfer latency (notification, descriptor setup)
    decode_load_weight: float = 0.05  # how much each decode running on D slows D's own prefill (x its work)
    holder_max_extra_load: float = 4.0  # the holder may be this much more loaded than the least-loaded D
    local_prefill: bool = True  # whether option 3 may be chosen at all

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.default_bytes_per_s <= 0:
            raise ValueError("kv_bytes_per_token and default_bytes_per_s must be positive")
        if min(self.attention_s_per_token_pair, self.pull_fixed_s, self.decode_load_weight) < 0:
            raise ValueError("costs must not be negative")
        if self.holder_max_extra_load < 0:
            raise ValueError("holder_max_extra_load must not be negative")


@dataclass(frozen=True, slots=True)
class PlacementInput:
    """One turn, as the router knows it after the lookup and the reuse decision."""

    prompt_tokens: int
    # K: the verified history P may pull (reuse.decide's plan, block-floored, below the prompt); 0: none.
    history_tokens: int
    holder_id: str  # the engine holding that history ("" when none)
    prefill: EngineFigures  # the P the pool chose
    decode: EngineFigures  # the least-loaded D (may be the holder)
    # The holder as a decode target: None when it is not a healthy decode engine of this pool serving the model.
    holder: EngineFigures | None = None
    # Measured pull bandwidth, bytes/s, by (reader, source) engine id; a missing link uses Costs.default_bytes_per_s.
    bytes_per_s: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.history_tokens < 0:
            raise ValueError("token counts must not be negative")
        if self.holder is not None and self.holder.engine_id != self.holder_id:
            raise ValueError("holder figures must be the holder's")


@dataclass(frozen=True, slots=True)
class Option:
    """One way to serve the turn, with its estimate."""

    choice: Choice
    prefill: str | None  # P's engine id (None: no P)
    decode: str  # D's engine id
    ttft_s: float  # estimated time until D's first decode step can run
    history_to_p: int  # tokens P pulls from the holder
    prompt_to_d: int  # tokens D pulls from P
    computed: int  # tokens prefilled (on P, or on the holder)

    @property
    def moved_tokens(self) -> int:
        return self.history_to_p + self.prompt_to_d


@dataclass(frozen=True, slots=True)
class Placement:
    chosen: Option
    reason: Why
    options: tuple[Option, ...]  # everything considered (the chosen one included)

    @property
    def choice(self) -> Choice:
        return self.chosen.choice

    def estimate(self, choice: Choice) -> float | None:
        """The best estimate of ``choice`` among the options considered (None: not considered)."""
        times = [o.ttft_s for o in self.options if o.choice is choice]
        return min(times) if times else None

    @property
    def label(self) -> str:
        """``<choice>;reason=<why>``: the ``x-kvbridge-placement`` header."""
        return f"{self.chosen.choice.value};reason={self.reason.value}"


def prefill_seconds(engine: EngineFigures, new: int, context: int, costs: Costs) -> float:
    """Seconds to prefill ``new`` tokens after ``context`` cached ones on an idle ``engine``."""
    if new <= 0:
        return 0.0
    linear = engine.prefill_fixed_s + engine.prefill_s_per_token * new
    return linear + costs.attention_s_per_token_pair * new * (context + new / 2)


def transfer_seconds(tokens: int, bytes_per_s: float, costs: Costs) -> float:
    """Seconds to pull ``tokens`` tokens' KV over a link of ``bytes_per_s``."""
    if tokens <= 0:
        return 0.0
    return costs.pull_fixed_s + tokens * costs.kv_bytes_per_token / bytes_per_s


def place(turn: PlacementInput, costs: Costs) -> Placement:
    """The cheapest way to serve ``turn`` among those its history and its holder's state allow."""
    n = turn.prompt_tokens
    k = min(turn.history_tokens, max(0, n - 1)) if turn.holder_id else 0
    p, least = turn.prefill, turn.decode

    def link(reader: str, source: str) -> float:
        bw = turn.bytes_per_s.get((reader, source), costs.default_bytes_per_s)
        return bw if bw > 0 else costs.default_bytes_per_s

    def p_side(new: int, context: int) -> float:
        return (1 + p.outstanding) * prefill_seconds(p, new, context, costs)

    def recompute(d: EngineFigures, cached: int) -> Option:
        to_d = n - cached
        ttft = p_side(n, 0) + transfer_seconds(to_d, link(d.engine_id, p.engine_id), costs)
        return Option(Choice.RECOMPUTE, p.engine_id, d.engine_id, ttft, 0, to_d, n)

    if k <= 0:
        only = recompute(least, 0)
        return Placement(only, Why.NO_HISTORY, (only,))

    holder = turn.holder
    if holder is None:
        reason, targets = Why.HOLDER_UNAVAILABLE, [least]
    elif holder.engine_id != least.engine_id and holder.load - least.load > costs.holder_max_extra_load:
        reason, targets = Why.HOLDER_OVERLOADED, [least]
        holder = None
    else:
        reason = Why.CHEAPEST
        targets = [holder] if holder.engine_id == least.engine_id else [holder, least]
    options: list[Option] = []
    for d in targets:
        cached = k if holder is not None and d.engine_id == holder.engine_id else 0
        options.append(recompute(d, cached))
        to_d = n - cached
        ttft = (
            transfer_seconds(k, link(p.engine_id, turn.holder_id), costs)
            + p_side(n - k, k)
            + transfer_seconds(to_d, link(d.engine_id, p.engine_id), costs)
        )
        options.append(Option(Choice.PULL_TO_P, p.engine_id, d.engine_id, ttft, k, to_d, n - k))
    if holder is not None and costs.local_prefill:
        slowdown = 1 + holder.prefilling + costs.decode_load_weight * holder.decodes
        ttft = slowdown * prefill_seconds(holder, n - k, k, costs)
        options.append(Option(Choice.PREFILL_ON_HOLDER, None, holder.engine_id, ttft, 0, 0, n - k))
    chosen = min(options, key=lambda o: (o.ttft_s, o.moved_tokens, _RANK[o.choice]))
    return Placement(chosen, reason, tuple(options))
