"""Tracing helpers every kvbridge component may use, including the vLLM connector.

``opentelemetry-api`` is optional here: without it every helper is a cheap no-op, so
the API package never depends on the SDK (or even on the API). With it, the helpers use
the global propagator (W3C ``traceparent`` by default, ``OTEL_PROPAGATORS`` honoured)
and whatever tracer the caller passes or the global tracer provider.

Tenant names and conversation keys are never exported raw: :func:`hash_attribute`
turns them into a keyed SHA-256 prefix, stable for one key, so one conversation's
turns can be found together without revealing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

try:  # optional: the connector and SDK users may run without OpenTelemetry
    from opentelemetry import propagate as _otel_propagate
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised only where opentelemetry-api is absent
    _otel_propagate = None  # type: ignore[assignment]
    _otel_trace = None  # type: ignore[assignment]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# Span attribute names shared by every component (values hashed where noted).
ATTR_TENANT = "kvbridge.tenant.hash"
ATTR_CONVERSATION = "kvbridge.conversation.hash"
ATTR_MODEL = "kvbridge.model"
ATTR_ENGINE = "kvbridge.engine.id"
ATTR_VERIFIED_TOKENS = "kvbridge.reuse.verified_tokens"
ATTR_PULLED_TOKENS = "kvbridge.reuse.pulled_tokens"
ATTR_PULL_BYTES = "kvbridge.pull.bytes"
ATTR_PULL_SECONDS = "kvbridge.pull.seconds"
ATTR_VERDICT = "kvbridge.reuse.verdict"
ATTR_REASON = "kvbridge.reuse.reason"

_HASH_HEX_CHARS = 16  # 64 bits: enough to tell conversations apart in a trace backend


def tracing_available() -> bool:
    return _otel_trace is not None


def hash_attribute(value: str, key: bytes) -> str:
    """Keyed SHA-256 (HMAC) of ``value``, first 16 hex chars; "" stays "" (absent, not hashed)."""
    if not value:
        return ""
    return hmac.new(key, value.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:_HASH_HEX_CHARS]


def identity_attributes(key: bytes, *, tenant: str = "", conversation_key: str = "") -> dict[str, str]:
    """Hashed tenant / conversation attributes, leaving out the empty ones."""
    out: dict[str, str] = {}
    if tenant:
        out[ATTR_TENANT] = hash_attribute(tenant, key)
    if conversation_key:
        out[ATTR_CONVERSATION] = hash_attribute(conversation_key, key)
    return out


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Adds the current trace context (``traceparent``, ...) to ``carrier`` (HTTP headers, gRPC metadata)."""
    if _otel_propagate is not None:
        _otel_propagate.inject(carrier)
    return carrier


def trace_headers() -> dict[str, str]:
    """The current trace context as a fresh header dict (empty when there is no active span)."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str]) -> Any:
    """An OpenTelemetry Context parented on ``carrier``'s trace context (None without OpenTelemetry)."""
    if _otel_propagate is None:
        return None
    return _otel_propagate.extract(carrier)


def metadata_carrier(metadata: Any) -> dict[str, str]:
    """gRPC metadata (pairs, str or bytes values) as a carrier for :func:`extract`; binary keys skipped."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(key, str) and not key.endswith("-bin") and isinstance(value, str):
            carrier[key.lower()] = value
    return carrier


@contextlib.contextmanager
def start_span(name: str, *, tracer: Any = None, parent: Mapping[str, str] | None = None,
               attributes: Mapping[str, Any] | None = None, kind: str = "internal") -> Iterator[Any]:
    """A span as the current span, or a no-op when OpenTelemetry is absent.

    ``parent``: a carrier (e.g. the ``traceparent`` a gateway put into kv_transfer_params
    or request headers) to continue that trace; otherwise the current context is the parent.
    ``kind``: internal | server | client | producer | consumer.
    """
    if _otel_trace is None:
        yield None
        return
    tracer = tracer or _otel_trace.get_tracer("kvbridge")
    ctx = extract(parent) if parent else None
    span_kind = getattr(_otel_trace.SpanKind, kind.upper(), _otel_trace.SpanKind.INTERNAL)
    with tracer.start_as_current_span(name, context=ctx, kind=span_kind,
                                      attributes=dict(attributes or {})) as span:
        yield span


def current_traceparent() -> str:
    """The current span's ``traceparent`` value, "" when none (for fields that travel in request bodies)."""
    return trace_headers().get(TRACEPARENT, "")


__all__ = [
    "ATTR_CONVERSATION", "ATTR_ENGINE", "ATTR_MODEL", "ATTR_PULLED_TOKENS", "ATTR_PULL_BYTES", "ATTR_PULL_SECONDS",
    "ATTR_REASON", "ATTR_TENANT", "ATTR_VERDICT", "ATTR_VERIFIED_TOKENS", "TRACEPARENT", "TRACESTATE",
    "current_traceparent", "extract", "hash_attribute", "identity_attributes", "inject", "metadata_carrier",
    "start_span", "trace_headers", "tracing_available",
]
