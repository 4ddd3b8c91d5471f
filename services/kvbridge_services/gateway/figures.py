"""What the placement cost model (placement.py) measures: each engine's prefill speed and each link's pull
bandwidth, from the prefill calls the gateway already times. No I/O; the caller passes what it saw.

* **Prefill speed**, per engine: an exponentially weighted least-squares line ``seconds = fixed + a * tokens``
  over its plain prefills (the configured attention term taken out first, and the call's time divided by
  ``1 + k`` when ``k`` other prefills were in flight on it: the same queue model the cost model uses). Until
  an engine has a sample it gets the configured default.
* **Pull bandwidth**, per (reader, source) link: from a prefill that pulled history from D, the call's time
  minus the prefill's estimate (from the line above) is the pull; its bytes over that time is a sample. Taken
  only once the reader's line has a fitted intercept (three samples of different sizes): a ratio through the
  origin would leave the per-call overhead (HTTP, scheduling) in the remainder and read it as a slow link.
  Averaged as seconds per byte (a mean of times, not of rates), per link and over all links. A link without
  samples uses its reverse, then the all-links figure, then the configured default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["DecayingLine", "Figures", "PrefillFit"]

# Clamps on what a sample may say: a fit outside them is noise (a stalled call, a clock step).
_MIN_S_PER_TOKEN = 1e-9
_MAX_S_PER_TOKEN = 1.0
_MIN_PULL_S = 1e-4  # a pull estimated shorter than this tells nothing (the prefill estimate's own error)
_MIN_BYTES_PER_S = 1e6
_MAX_BYTES_PER_S = 1e13

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _slot(table: OrderedDict[K, V], key: K, make: Callable[[], V], cap: int) -> V:
    """``table[key]``, made by ``make`` when missing (dropping the least recently used entry at ``cap``)."""
    value = table.get(key)
    if value is None:
        if len(table) >= cap:
            table.popitem(last=False)
        value = table[key] = make()
    else:
        table.move_to_end(key)
    return value


@dataclass(frozen=True, slots=True)
class PrefillFit:
    fixed_s: float
    s_per_token: float
    samples: int
    line: bool = False  # the intercept was fitted (not a ratio through the origin, not the default)


class DecayingLine:
    """Least squares ``y = c + a x`` over samples weighted ``w (1 - w)^age``: recent calls count most."""

    __slots__ = ("_s1", "_sx", "_sxx", "_sxy", "_sy", "_w", "samples")

    def __init__(self, weight: float) -> None:
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self._w = weight
        self._s1 = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.samples = 0

    def add(self, x: float, y: float) -> None:
        keep, w = 1 - self._w, self._w
        self._s1 = keep * self._s1 + w
        self._sx = keep * self._sx + w * x
        self._sy = keep * self._sy + w * y
        self._sxx = keep * self._sxx + w * x * x
        self._sxy = keep * self._sxy + w * x * y
        self.samples += 1

    def fit(self) -> tuple[float, float, bool] | None:
        """``(c, a, line)`` with ``c >= 0`` and ``a > 0``, or None before the first sample. With too little
        spread in ``x`` (or a fit that says a negative slope or intercept) it is the ratio ``y / x`` through the
        origin (``line`` False)."""
        if self.samples == 0 or self._sx <= 0:
            return None
        ratio = self._sy / self._sx
        if self.samples >= 3:
            mean_x, mean_y = self._sx / self._s1, self._sy / self._s1
            var = self._sxx / self._s1 - mean_x * mean_x
            if var > 1e-6 * (self._sxx / self._s1):
                a = (self._sxy / self._s1 - mean_x * mean_y) / var
                c = mean_y - a * mean_x
                if a > 0 and c >= 0:
                    return c, a, True
        return 0.0, ratio, False


class _Ewma:
    __slots__ = ("_w", "samples", "value")

    def __init__(self, weight: float) -> None:
        self._w = weight
        self.value = 0.0
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - self._w) * self.value + self._w * x
        self.samples += 1


class Figures:
    """Measured prefill speed per engine and pull bandwidth per link (bounded tables, oldest dropped)."""

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
        max_links: int = 65_536,
    ) -> None:
        self.default_s_per_token = prefill_s_per_token
        self.default_bytes_per_s = pull_bytes_per_s
        self._bytes_per_token = kv_bytes_per_token
        self._attention = attention_s_per_token_pair
        self._pull_fixed_s = pull_fixed_s
        self._weight = weight
        self._max_engines = max_engines
        self._max_links = max_links
        self._prefill: OrderedDict[str, DecayingLine] = OrderedDict()
        self._links: OrderedDict[tuple[str, str], _Ewma] = OrderedDict()
        self._all_links = _Ewma(weight)

    # -- reading -----------------------------------------------------------------------------
    def prefill(self, engine: str) -> PrefillFit:
        """The engine's prefill line, or the default (fixed 0) before its first sample."""
        line = self._prefill.get(engine)
        fit = line.fit() if line is not None else None
        if fit is None or line is None:
            return PrefillFit(0.0, self.default_s_per_token, 0)
        c, a, fitted = fit
        return PrefillFit(c, min(max(a, _MIN_S_PER_TOKEN), _MAX_S_PER_TOKEN), line.samples, fitted)

    def pool_prefill(self, engines: list[str]) -> PrefillFit:
        """The mean measured line of ``engines`` (those with samples), else the default: what an engine that
        is not timed itself (a decode engine's local prefill) is taken to do."""
        fits = [self.prefill(e) for e in engines]
        measured = [f for f in fits if f.samples]
        if not measured:
            return PrefillFit(0.0, self.default_s_per_token, 0)
        return PrefillFit(
            sum(f.fixed_s for f in measured) / len(measured),
            sum(f.s_per_token for f in measured) / len(measured),
            sum(f.samples for f in measured),
        )

    def bytes_per_s(self, reader: str, source: str) -> float:
        """The link's measured bandwidth (its reverse's, every link's) or the default."""
        for key in ((reader, source), (source, reader)):
            ewma = self._links.get(key)
            if ewma is not None and ewma.samples:
                return _bandwidth(ewma.value)
        if self._all_links.samples:
            return _bandwidth(self._all_links.value)
        return self.default_bytes_per_s

    @property
    def measured_bytes_per_s(self) -> float | None:
        """Every link's figure, None before the first pull sample."""
        return _bandwidth(self._all_links.value) if self._all_links.samples else None

    # -- observing ---------------------------------------------------------------------------
    def observe_prefill(self, engine: str, *, computed: int, context: int, seconds: float, others: int) -> None:
        """A plain prefill on ``engine``: ``computed`` tokens after ``context`` cached ones took ``seconds``,
        with ``others`` prefills of this gateway in flight on it when it started."""
        if computed <= 0 or seconds <= 0:
            return
        own = seconds / (1 + max(0, others)) - self._attention_s(computed, context)
        if own <= 0:
            return
        line = _slot(self._prefill, engine, lambda: DecayingLine(self._weight), self._max_engines)
        line.add(float(computed), own)

    def observe_pull(
        self, reader: str, source: str, *, pulled: int, computed: int, context: int, seconds: float, others: int
    ) -> None:
        """A prefill on ``reader`` that pulled ``pulled`` tokens from ``source`` and computed ``computed`` more
        (after ``context`` cached ones) took ``seconds``: the part beyond the prefill's estimate was the pull."""
        fit = self.prefill(reader)
        if pulled <= 0 or seconds <= 0 or not fit.line:
            return
        work = fit.fixed_s + fit.s_per_token * computed + self._attention_s(computed, context) if computed > 0 else 0
        pull_s = seconds - (1 + max(0, others)) * work - self._pull_fixed_s
        if pull_s < _MIN_PULL_S:
            return
        s_per_byte = pull_s / (pulled * self._bytes_per_token)
        _slot(self._links, (reader, source), lambda: _Ewma(self._weight), self._max_links).add(s_per_byte)
        self._all_links.add(s_per_byte)

    def _attention_s(self, new: int, context: int) -> float:
        return self._attention * new * (context + new / 2)


def _bandwidth(s_per_byte: float) -> float:
    if s_per_byte <= 0:
        return _MAX_BYTES_PER_S
    return min(max(1.0 / s_per_byte, _MIN_BYTES_PER_S), _MAX_BYTES_PER_S)
