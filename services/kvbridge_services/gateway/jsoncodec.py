"""JSON at the gateway's edges: client bodies parsed strictly, engine bodies encoded and parsed fast (ADR 0021).

A 24K-token prompt travels to P and to D as a list of token ids: the standard library encodes it in ~1.4 ms,
orjson in ~0.1 ms; D's answer carries the prompt's ids back (``return_token_ids``, compatibility mode): ~1.2 ms
to parse with the standard library, ~0.45 ms with orjson (bench/results/gateway_by_size.md). orjson would write
a NaN or an infinity as ``null``, silently altering a value, so client bodies are parsed strictly (NaN,
Infinity and overflowing floats are not JSON, RFC 8259) and can never hold one; integers beyond 64 bits, which
orjson refuses, go through the standard library encoder unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def loads_strict(raw: bytes | str) -> Any:
    """``json.loads`` refusing NaN, Infinity and floats that overflow (ValueError), keeping big integers exact."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of a value the standard library reads back unchanged (no NaN or infinity: the
    strict parse and the sampling checks keep them out; the fallback refuses one with ValueError)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits, a lone surrogate: the standard library writes them exactly
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def loads_engine(raw: bytes) -> Any:
    """An engine's JSON answer. vLLM writes it (pydantic, from Python ints and finite floats), so orjson reads it
    exactly; what orjson refuses (NaN, a lone surrogate) is read by the standard library instead."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
