"""What the placement cost model (placement.py) measures: each prefill engine's speed and pull bandwidth, from
the prefill calls the gateway already times. No I/O; the caller passes what it saw.

One exponentially weighted least-squares fit per prefill engine over all its timed prefills, plain or pulling:

    seconds / (1 + k) = fixed + a * computed + b * pulled / (1 + k)

``computed`` new tokens (the configured attention term taken out of ``seconds`` first), ``pulled`` tokens read
from a decode engine (the configured per-pull latency taken out too), ``k`` other prefills of this gateway in
flight on it when the call started: the cost model's own queue model (prefills share the engine, a pull does
not). ``fixed`` is the per-call overhead (HTTP, scheduling), ``a`` the prefill seconds per token and ``b`` the
seconds per pulled token, so the engine's pull bandwidth is ``kv_bytes_per_token / b``. Fitting them together
keeps the per-call overhead out of the pull (a pull timed against a prefill estimate through the origin read the
overhead as a slow link) and needs no plain prefills of different sizes: plain and pulling calls differ in both
token counts. While the samples cannot separate the three (no pulls yet, all prompts one size), ``a`` is the
ratio through the origin and the bandwidth stays unmeasured. Defaults until then.

The bandwidth is per reading engine (P), over the decode engines it read from; a link whose reader is not timed
(D pulling from P) uses the source's figure, then the mean over measured engines, then the default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DecayingFit", "Figures", "PrefillFit"]

# Clamps on what a fit may say: outside them it is noise (a stalled call, a clock step).
_MIN_S_PER_TOKEN = 1e-9
_MAX_S_PER_TOKEN = 1.0
_MIN_BYTES_PER_S = 1e6
_MAX_BYTES_PER_S = 1e13
_FIXED, _COMPUTED, _PULLED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class PrefillFit:
    fixed_s: float
    s_per_token: float
    samples: int
    line: bool = False  # the intercept was fitted (not a ratio through the origin, not the default)
    pull_s_per_token: float | None = None  # b, when the samples separate it


class DecayingFit:
    """Least squares ``y = sum(beta_i x_i)`` over samples weighted ``w (1 - w)^age``: recent calls count most."""

    __slots__ = ("_g", "_h", "_w", "samples", "seen")

    def __init__(self, features: int, weight: float) -> None:
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self._w = weight
        self._g = [[0.0] * features for _ in range(features)]  # the weighted Gram matrix
        self._h = [0.0] * features
        self.samples = 0
        self.seen = [0] * features  # samples in which each feature was not zero

    def add(self, x: Sequence[float], y: float) -> None:
        keep, w = 1 - self._w, self._w
        for i, xi in enumerate(x):
            for j, xj in enumerate(x):
                self._g[i][j] = keep * self._g[i][j] + w * xi * xj
            self._h[i] = keep * self._h[i] + w * xi * y
            self.seen[i] += xi != 0
        self.samples += 1

    def solve(self, features: Sequence[int]) -> list[float] | None:
        """The coefficients of ``features`` (the others taken as 0), or None when the samples cannot tell them
        apart (a pivot below 1e-9 of its column's scale)."""
        n = len(features)
        if self.samples < n:
            return None
        m = [[self._g[i][j] for j in features] + [self._h[i]] for i in features]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
            scale = max(abs(m[r][col]) for r in range(n)) or 1.0
            if abs(m[pivot][col]) <= 1e-9 * scale:
                return None
            m[col], m[pivot] = m[pivot], m[col]
            for r in range(n):
                if r != col:
                    factor = m[r][col] / m[col][col]
                    m[r] = [a - factor * b for a, b in zip(m[r], m[col], strict=True)]
        return [m[i][n] / m[i][i] for i in range(n)]


class Figures:
    """Measured prefill speed and pull bandwidth per prefill engine (a bounded table, least recently used dropped)."""

    def __init__(
        self,
        *,
        prefill_s_per_token: float,
        pull_bytes_per_s: float,
        kv_bytes_per_token: float,
        attention_s_per_token_pair: float = 0.0,
        pull_fixed_s: float = 0.0,
        weight: float = 0.2,
        max_engines: int = 4096,
    ) -> None:
        self.default_s_per_token = prefill_s_per_token
        self.default_bytes_per_s = pull_bytes_per_s
        self._bytes_per_token = kv_bytes_per_token
        self._attention = attention_s_per_token_pair
        self._pull_fixed_s = pull_fixed_s
        self._weight = weight
        self._max_engines = max_engines
        self._fits: OrderedDict[str, DecayingFit] = OrderedDict()

    # -- reading -----------------------------------------------------------------------------
    def prefill(self, engine: str) -> PrefillFit:
        """The engine's fit, or the default (fixed 0) before its first sample."""
        fit = self._fits.get(engine)
        if fit is None or fit.samples == 0:
            return PrefillFit(0.0, self.default_s_per_token, 0)
        pulls = fit.seen[_PULLED] > 0
        full = fit.solve((_FIXED, _COMPUTED, _PULLED) if pulls else (_FIXED, _COMPUTED))
        if full is not None and full[0] >= 0 and min(full[1:]) > 0:
            pull = full[2] if pulls else None
            return PrefillFit(full[0], _clamp(full[1]), fit.samples, True, pull)
        ratio = fit.solve((_COMPUTED, _PULLED) if pulls else (_COMPUTED,)) or fit.solve((_COMPUTED,))
        a = ratio[0] if ratio is not None and ratio[0] > 0 else self.default_s_per_token
        return PrefillFit(0.0, _clamp(a), fit.samples)

    def pool_prefill(self, engines: list[str]) -> PrefillFit:
        """The mean measured line of ``engines`` (those with samples), else the default: what an engine that
        is not timed itself (a decode engine's local prefill) is taken to do."""
        measured = [f for f in map(self.prefill, engines) if f.samples]
        if not measured:
            return PrefillFit(0.0, self.default_s_per_token, 0)
        return PrefillFit(
            sum(f.fixed_s for f in measured) / len(measured),
            sum(f.s_per_token for f in measured) / len(measured),
            sum(f.samples for f in measured),
        )

    def bytes_per_s(self, reader: str, source: str) -> float:
        """The reader's measured pull bandwidth (else the source's, every engine's) or the default."""
        for engine in (reader, source):
            if engine in self._fits:
                b = self.prefill(engine).pull_s_per_token
                if b is not None:
                    return self._bandwidth(b)
        measured = self.measured_bytes_per_s
        return self.default_bytes_per_s if measured is None else measured

    @property
    def measured_bytes_per_s(self) -> float | None:
        """The bandwidth of the mean measured seconds per pulled token over all engines (None: none measured)."""
        pulls = [b for e in self._fits if (b := self.prefill(e).pull_s_per_token) is not None]
        return self._bandwidth(sum(pulls) / len(pulls)) if pulls else None

    # -- observing ---------------------------------------------------------------------------
    def observe_prefill(self, engine: str, *, computed: int, context: int, seconds: float, others: int) -> None:
        """A plain prefill on ``engine``: ``computed`` tokens after ``context`` cached ones took ``seconds``,
        with ``others`` prefills of this gateway in flight on it when it started."""
        self.observe_pull(engine, "", pulled=0, computed=computed, context=context, seconds=seconds, others=others)

    def observe_pull(
        self, reader: str, source: str, *, pulled: int, computed: int, context: int, seconds: float, others: int
    ) -> None:
        """A prefill on ``reader`` that pulled ``pulled`` tokens (from ``source``) and computed ``computed`` more
        after ``context`` cached ones took ``seconds``."""
        if seconds <= 0 or (computed <= 0 and pulled <= 0):
            return
        share = 1 + max(0, others)
        y = (seconds - (self._pull_fixed_s if pulled > 0 else 0.0)) / share - self._attention_s(computed, context)
        if y <= 0:
            return
        fit = self._fits.get(reader)
        if fit is None:
            if len(self._fits) >= self._max_engines:
                self._fits.popitem(last=False)
            fit = self._fits[reader] = DecayingFit(3, self._weight)
        else:
            self._fits.move_to_end(reader)
        fit.add((1.0, float(max(0, computed)), max(0, pulled) / share), y)

    def _attention_s(self, new: int, context: int) -> float:
        return self._attention * max(0, new) * (context + new / 2)

    def _bandwidth(self, s_per_token: float) -> float:
        if s_per_token <= 0:
            return _MAX_BYTES_PER_S
        return min(max(self._bytes_per_token / s_per_token, _MIN_BYTES_PER_S), _MAX_BYTES_PER_S)


def _clamp(s_per_token: float) -> float:
    return min(max(s_per_token, _MIN_S_PER_TOKEN), _MAX_S_PER_TOKEN)
