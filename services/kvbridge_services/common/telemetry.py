"""Tracing and metrics plumbing every service shares.

A :class:`Telemetry` is one service's bundle: its tracer (own TracerProvider, so the three
services of an embedded all-in-one process keep their own ``service.name``), the key that
hashes tenant / conversation attributes, and the Prometheus registry its ``/metrics`` serves.

Tracing is configured by the standard ``OTEL_*`` variables and is OFF unless
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set or
``OTEL_TRACES_EXPORTER`` names ``otlp``; the exporter is OTLP/gRPC. Only composition roots
call :meth:`Telemetry.from_env`; everything else receives the object (or a disabled one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry, ProcessCollector
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvbridge import telemetry as api_telemetry

from .handler_cache import WrappingInterceptor
from .metric_factory import MetricFactory

log = logging.getLogger(__name__)

# Probes and tooling calls would drown real traffic in traces.
_UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Server-side failures (OpenTelemetry gRPC conventions): other codes are the client's problem.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
# The global provider until a process installs a real one: its spans are dropped.
_NO_OP_PROVIDERS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
# How long shutdown (and force_flush) wait for the span exporter: with the OTLP collector down its retries would
# hold a stopping service ~15 s (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s, plus backoff); past it the spans are dropped.
SHUTDOWN_TIMEOUT_S = 2.0

# OpenTelemetry's GenAI semantic conventions (gen_ai.*), beside kvbridge's own attributes on a turn's span.
GEN_AI_SYSTEM = "vllm"
_GEN_AI_OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def gen_ai_request(kind: str, model: str) -> dict[str, str]:
    """A turn's request attributes: ``gen_ai.operation.name`` (``chat`` or ``text_completion``), ``gen_ai.system``
    and ``gen_ai.request.model``."""
    return {
        "gen_ai.operation.name": _GEN_AI_OPERATIONS.get(kind, kind),
        "gen_ai.system": GEN_AI_SYSTEM,
        "gen_ai.request.model": model,
    }


def gen_ai_usage(usage: object) -> dict[str, int]:
    """``gen_ai.usage.input_tokens`` / ``output_tokens`` from an OpenAI ``usage`` object (what it holds of them)."""
    out: dict[str, int] = {}
    if isinstance(usage, dict):
        for key, attr in (
            ("prompt_tokens", "gen_ai.usage.input_tokens"),
            ("completion_tokens", "gen_ai.usage.output_tokens"),
        ):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out[attr] = value
    return out


def server_attributes(url: str) -> dict[str, str | int]:
    """``server.address`` (a host, as the conventions define it, never a URL) and ``server.port`` of a URL."""
    parts = urlsplit(url)
    out: dict[str, str | int] = {"server.address": parts.hostname or url}
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None and parts.scheme in ("http", "https"):
        port = 443 if parts.scheme == "https" else 80
    if port is not None:
        out["server.port"] = port
    return out


class TelemetrySettings(BaseSettings):
    """kvbridge's own telemetry knobs (``KVBRIDGE_TELEMETRY_*``); exporting is configured by ``OTEL_*``."""

    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_TELEMETRY_", extra="ignore")

    # Hex key of the tenant / conversation attribute hash; share it across services so the same
    # conversation hashes alike everywhere. Empty: a random per-process key (hashes differ per process).
    hash_key_hex: str = Field(default="", repr=False)

    @field_validator("hash_key_hex")
    @classmethod
    def _check_key(cls, value: str) -> str:
        if value and not 16 <= len(bytes.fromhex(value)) <= 64:
            raise ValueError("hash_key_hex must decode to 16..64 bytes")
        return value


# One definition of "the OTEL_* variables ask for trace export", shared with the connector.
tracing_enabled = api_telemetry.otlp_traces_configured


def _otlp_exporter(environ: Mapping[str, str]) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "grpc":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: kvbridge exports OTLP over gRPC only", protocol)
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    # The exporter reads the other OTEL_EXPORTER_OTLP_* variables (headers, TLS, timeout) itself.
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


class RpcMetrics:
    """Per-method gRPC server counters and latency, registered in the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricFactory(registry)
        self.handled = m.counter(
            "kvbridge_grpc_server_handled_total", "RPCs completed, by method and status code", ["method", "code"]
        )
        self.seconds = m.histogram(
            "kvbridge_grpc_server_handling_seconds",
            "RPC handling time, by method",
            ["method"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
        )


class Telemetry:
    """One service's tracer, attribute hasher and metrics registry."""

    def __init__(
        self,
        service_name: str,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        hash_key: bytes | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.service_name = service_name
        # None: the global provider (a no-op unless the process configured one).
        self._provider = tracer_provider
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(f"kvbridge.{service_name}")
        self._hash_key = hash_key or secrets.token_bytes(32)
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)  # process_* (CPU, memory, open fds, start time) on every service
        self.registry = registry
        self.rpc_metrics = RpcMetrics(self.registry)
        self._exporter: SpanExporter | None = None
        self._tracing = self.exporting or not isinstance(trace.get_tracer_provider(), _NO_OP_PROVIDERS)

    @classmethod
    def disabled(cls, service_name: str) -> Telemetry:
        return cls(service_name)

    @classmethod
    def from_env(
        cls,
        service_name: str,
        environ: Mapping[str, str] | None = None,
        *,
        settings: TelemetrySettings | None = None,
        exporter: SpanExporter | None = None,
    ) -> Telemetry:
        """Tracing per ``OTEL_*`` (``OTEL_SERVICE_NAME`` overrides ``service_name``); composition roots only."""
        env = os.environ if environ is None else environ
        settings = settings or TelemetrySettings()
        key = bytes.fromhex(settings.hash_key_hex) if settings.hash_key_hex else None
        name = env.get("OTEL_SERVICE_NAME") or service_name
        if exporter is None and not tracing_enabled(env):
            return cls(name, hash_key=key)
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        span_exporter = exporter or _otlp_exporter(env)
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
        log.info("tracing on: service.name=%s", name)
        telemetry = cls(name, tracer_provider=provider, hash_key=key)
        telemetry._exporter = span_exporter
        return telemetry

    @property
    def exporting(self) -> bool:
        return isinstance(self._provider, TracerProvider)

    def identity(self, *, tenant: str = "", conversation_key: str = "") -> dict[str, str]:
        """Span attributes for a tenant / conversation, hashed with this service's key."""
        return api_telemetry.identity_attributes(self._hash_key, tenant=tenant, conversation_key=conversation_key)

    def hash(self, value: str) -> str:
        return api_telemetry.hash_attribute(value, self._hash_key)

    @property
    def tracing(self) -> bool:
        """Whether spans go anywhere: this service's exporter, or a tracer provider the process had installed when
        this object was built (asked once: get_tracer_provider() reads os.environ on every call)."""
        return self._tracing

    def server_interceptor(self) -> ServerTelemetryInterceptor:
        return ServerTelemetryInterceptor(self.tracer, self.rpc_metrics, tracing=self.tracing)

    def force_flush(self, timeout_ms: int = int(SHUTDOWN_TIMEOUT_S * 1000)) -> bool:
        """Exports the spans ended so far; False if that took longer than ``timeout_ms`` (the SDK's batch
        processor ignores its own timeout and would wait out the exporter's retries)."""
        provider = self._provider
        if not isinstance(provider, TracerProvider):
            return True
        return _bounded(lambda: provider.force_flush(timeout_ms), timeout_ms / 1000)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Exports what is left and stops the exporter, within ``timeout_s``: past it (the collector is down or
        slow) the exporter is stopped, which ends its retries, and the spans left are dropped with a warning."""
        provider = self._provider
        if not isinstance(provider, TracerProvider):
            return
        if not _bounded(provider.shutdown, timeout_s):
            log.warning(
                "tracing: spans not exported within %.1f s at shutdown (is the OTLP collector reachable?); dropped",
                timeout_s,
            )
            if self._exporter is not None:
                self._exporter.shutdown()  # the OTLP exporter's retries and in-flight export end


def _bounded(call: Callable[[], object], timeout_s: float) -> bool:
    """Runs ``call`` on a daemon thread; whether it returned (truthy or None) within ``timeout_s``."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), name="kvbridge-telemetry-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result) and result[0] is not False


# ------------------------------------------------------------------------------------------ server side

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


def _status_code(context: grpc.aio.ServicerContext[Any, Any], failed: bool) -> grpc.StatusCode:
    code: Any = context.code()
    if isinstance(code, int):
        code = _CODES_BY_VALUE.get(code)
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class ServerTelemetryInterceptor(WrappingInterceptor):
    """A SERVER span per RPC (parented on the caller's W3C context in metadata) plus RPC metrics.

    Without ``tracing`` (no exporter anywhere) an RPC gets no span, no context switch and no metadata parsing,
    only its metrics: that saved ~40 µs per registry lookup. Each method's wrapper is built once (handler_cache).
    """

    def __init__(self, tracer: trace.Tracer, metrics: RpcMetrics | None = None, *, tracing: bool = True) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._tracing = tracing
        super().__init__(self._wrap, skip_prefixes=_UNTRACED_PREFIXES)
        # labels() resolves a child per call (µs each): the children of (method, code) once.
        self._handled: dict[tuple[str, grpc.StatusCode], Any] = {}

    def _wrap(self, method: str, handler: Any) -> Any:
        seconds = self._metrics.seconds.labels(method) if self._metrics is not None else None
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, seconds, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(method, seconds, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(method, seconds, handler.unary_stream))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._streaming(method, seconds, handler.stream_stream))
        return handler

    def _start(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> trace.Span | None:
        if not self._tracing:
            return None
        carrier = api_telemetry.metadata_carrier(context.invocation_metadata())
        service, _, name = method.lstrip("/").rpartition("/")
        return self._tracer.start_span(
            method.lstrip("/"),
            context=api_telemetry.extract(carrier) if carrier else None,
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )

    def _finish(
        self,
        span: trace.Span | None,
        method: str,
        seconds: Any,
        context: grpc.aio.ServicerContext[Any, Any],
        started: float,
        failed: bool,
    ) -> None:
        code = _status_code(context, failed)
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code in _SERVER_ERROR_CODES:
                span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
            span.end()
        if self._metrics is not None:
            handled = self._handled.get((method, code))
            if handled is None:
                handled = self._handled[(method, code)] = self._metrics.handled.labels(method, code.name)
            handled.inc()
            seconds.observe(time.perf_counter() - started)

    def _unary(self, method: str, seconds: Any, inner: Behavior) -> Behavior:
        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started, span, failed = time.perf_counter(), self._start(method, context), True
            try:
                if span is None:
                    result = await inner(request, context)
                else:
                    with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                        result = await inner(request, context)
                failed = False
                return result
            finally:
                self._finish(span, method, seconds, context, started, failed)

        return behavior

    def _streaming(self, method: str, seconds: Any, inner: Behavior) -> Behavior:
        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            started, span, failed = time.perf_counter(), self._start(method, context), True
            try:
                current = (
                    contextlib.nullcontext()
                    if span is None
                    else trace.use_span(span, record_exception=False, set_status_on_exception=False)
                )
                with current:
                    result = inner(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:  # a handler writing with context.write() and returning None
                        await result
                failed = False
            finally:
                self._finish(span, method, seconds, context, started, failed)

        return behavior


# ------------------------------------------------------------------------------------------ client side


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    headers = api_telemetry.trace_headers()
    if not headers:
        return details
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    for key, value in headers.items():
        metadata[key] = value
    return details._replace(metadata=metadata)  # type: ignore[attr-defined,no-any-return]


class _UnaryUnaryPropagation(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStreamPropagation(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnaryPropagation(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStreamPropagation(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors putting the caller's trace context (``traceparent``) into every outgoing call's metadata.

    They create no span: the caller's own span (e.g. the gateway's "registry lookup") becomes the
    parent of the callee's server span. One per call type: a grpc.aio channel files each interceptor
    under the first call type it implements only.
    Use: ``grpc.aio.insecure_channel(target, interceptors=client_interceptors())``.
    """
    return [_UnaryUnaryPropagation(), _UnaryStreamPropagation(), _StreamUnaryPropagation(), _StreamStreamPropagation()]
