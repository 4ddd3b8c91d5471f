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
import re
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
# The key under which the gateway puts its turn's ``traceparent`` into vLLM's kv_transfer_params,
# so the kvbridge connector in the engine can parent its spans on the turn (vLLM 0.32 only carries
# HTTP trace headers to the scheduler when its own tracing, --otlp-traces-endpoint, is on).
KV_PARAMS_TRACEPARENT = "kvbridge_traceparent"
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
ATTR_LOOKUP_SOURCE = "kvbridge.lookup.source"  # who answered a turn's lookup: mirror | registry

_TRACEPARENT_RE = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
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
def start_span(
    name: str,
    *,
    tracer: Any = None,
    parent: Mapping[str, str] | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
    start_time_ns: int | None = None,
) -> Iterator[Any]:
    """A span as the current span, or a no-op when OpenTelemetry is absent.

    ``parent``: a carrier (e.g. the ``traceparent`` a gateway put into kv_transfer_params
    or request headers) to continue that trace; otherwise the current context is the parent.
    ``kind``: internal | server | client | producer | consumer.
    ``start_time_ns``: Unix-epoch start when the work began before this call (e.g. queued).
    """
    if _otel_trace is None:
        yield None
        return
    tracer = tracer or _otel_trace.get_tracer("kvbridge")
    ctx = extract(parent) if parent else None
    with tracer.start_as_current_span(
        name, context=ctx, kind=_span_kind(kind), start_time=start_time_ns, attributes=dict(attributes or {})
    ) as span:
        yield span


def record_span(
    name: str,
    *,
    start_time_ns: int,
    end_time_ns: int,
    tracer: Any = None,
    parent: Mapping[str, str] | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
    error: str = "",
) -> None:
    """A finished span for work timed elsewhere (e.g. a transfer whose end is reported a step later).

    ``error``: non-empty marks the span failed with that description. No-op without OpenTelemetry.
    """
    if _otel_trace is None:
        return
    tracer = tracer or _otel_trace.get_tracer("kvbridge")
    span = tracer.start_span(
        name,
        context=extract(parent) if parent else None,
        kind=_span_kind(kind),
        attributes=dict(attributes or {}),
        start_time=start_time_ns,
    )
    if error:
        span.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR, error))
    span.end(end_time=max(end_time_ns, start_time_ns))


def _span_kind(kind: str) -> Any:
    assert _otel_trace is not None
    return getattr(_otel_trace.SpanKind, kind.upper(), _otel_trace.SpanKind.INTERNAL)


def traceparent_carrier(value: object) -> dict[str, str]:
    """``{"traceparent": value}`` for a well-formed W3C traceparent (lower-case, version 00 layout), else {}."""
    if isinstance(value, str) and len(value) == 55 and _TRACEPARENT_RE.fullmatch(value):
        return {TRACEPARENT: value}
    return {}


def otlp_traces_configured(environ: Mapping[str, str]) -> bool:
    """Whether the standard ``OTEL_*`` variables ask for OTLP trace export (endpoint set, or exporter ``otlp``)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or "otlp" in exporters


def current_traceparent() -> str:
    """The current span's ``traceparent`` value, "" when none (for fields that travel in request bodies)."""
    return trace_headers().get(TRACEPARENT, "")


__all__ = [
    "ATTR_CONVERSATION",
    "ATTR_ENGINE",
    "ATTR_MODEL",
    "ATTR_PULLED_TOKENS",
    "ATTR_PULL_BYTES",
    "ATTR_PULL_SECONDS",
    "ATTR_REASON",
    "ATTR_TENANT",
    "ATTR_VERDICT",
    "ATTR_VERIFIED_TOKENS",
    "KV_PARAMS_TRACEPARENT",
    "TRACEPARENT",
    "TRACESTATE",
    "current_traceparent",
    "extract",
    "hash_attribute",
    "identity_attributes",
    "inject",
    "metadata_carrier",
    "otlp_traces_configured",
    "record_span",
    "start_span",
    "trace_headers",
    "traceparent_carrier",
    "tracing_available",
]
