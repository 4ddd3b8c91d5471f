"""Connector spans: D registering retained blocks, P pulling them back (or declining to).

Off unless configured (``ConnectorSettings.otlp_endpoint``); then every method is a cheap
no-op and no OpenTelemetry SDK is imported. On, spans go through the connector's own
TracerProvider (``service.name`` = ``OTEL_SERVICE_NAME`` or ``kvbridge-connector``) to an
OTLP/gRPC endpoint, parented on the turn's trace: the ``kvbridge_traceparent`` the gateway puts
into ``kv_transfer_params``, else the ``traceparent`` vLLM keeps in ``Request.trace_headers``
(vLLM 0.32 fills those only when its own tracing, ``--otlp-traces-endpoint``, is on).

Tracing never raises into vLLM or the control-plane thread: a failure is logged (once per
kind) and that span is dropped. Tenant and conversation keys are exported hashed only.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvbridge import telemetry as tel
from kvbridge_connector.params import ConversationRef
from kvbridge_connector.pulls import FinishedPull
from kvbridge_connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")

SPAN_REGISTER = "kvbridge.connector.register_entry"
SPAN_PULL = "kvbridge.connector.pull"
ATTR_SOURCE_ENGINE = "kvbridge.source.engine_id"
ATTR_REQUEST = "kvbridge.engine.request_id"
ATTR_PULL_BLOCKS = "kvbridge.pull.blocks"
ATTR_OUTCOME = "kvbridge.outcome"
ATTR_RETAINED_TOKENS = "kvbridge.retained.tokens"
ATTR_RETAINED_BLOCKS = "kvbridge.retained.blocks"
ATTR_LEASE_ID = "kvbridge.lease.id"
ATTR_EPOCH = "kvbridge.epoch"
ATTR_QUEUED_SECONDS = "kvbridge.queued.seconds"

# A trace context travelling with a command: (key, value) pairs, empty when there is none.
Carrier = tuple[tuple[str, str], ...]


def request_parent(request: Request) -> Carrier:
    """The turn's trace context for ``request``: kv_transfer_params first, then vLLM's trace headers."""
    params = request.kv_transfer_params or {}
    carrier = tel.traceparent_carrier(params.get(tel.KV_PARAMS_TRACEPARENT))
    if not carrier:
        headers: Mapping[str, str] | None = getattr(request, "trace_headers", None)
        if headers:
            carrier = tel.traceparent_carrier(headers.get(tel.TRACEPARENT))
            state = headers.get(tel.TRACESTATE)
            if carrier and isinstance(state, str) and len(state) <= 512:
                carrier[tel.TRACESTATE] = state
    return tuple(carrier.items())


class SpanHandle:
    """Sets attributes on a live span (or on nothing); never raises."""

    def __init__(self, span: Any, tracer: ConnectorTracer) -> None:
        self._span = span
        self._tracer = tracer

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._span is None:
            return
        try:
            self._span.set_attribute(key, value)
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self._tracer.failed("set_attribute")


class ConnectorTracer:
    def __init__(
        self, tracer: Any = None, *, hash_key: bytes | None = None, engine_id: str = "", provider: Any = None
    ) -> None:
        # None: tracing off.
        self._tracer = tracer
        self._provider = provider
        self._hash_key = hash_key or secrets.token_bytes(32)
        self._engine_id = engine_id
        self._failures: set[str] = set()

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, engine_id: str) -> ConnectorTracer:
        if not settings.tracing_enabled:
            return cls(engine_id=engine_id)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(
                resource=Resource.create({"service.name": settings.service_name, tel.ATTR_ENGINE: engine_id})
            )
            exporter = (
                OTLPSpanExporter(endpoint=settings.otlp_endpoint) if settings.otlp_endpoint else OTLPSpanExporter()
            )
            provider.add_span_processor(BatchSpanProcessor(exporter))
        except Exception:
            log.warning("kvbridge: connector tracing requested but unavailable; tracing off", exc_info=True)
            return cls(engine_id=engine_id)
        log.info("kvbridge: connector tracing on (service.name=%s)", settings.service_name)
        return cls(
            provider.get_tracer("kvbridge.connector"),
            hash_key=settings.telemetry_hash_key,
            engine_id=engine_id,
            provider=provider,
        )

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def failed(self, what: str) -> None:
        if what not in self._failures:
            self._failures.add(what)
            log.warning("kvbridge: connector tracing failed in %s; span dropped", what, exc_info=True)

    # ---- scheduler thread ------------------------------------------------
    def parent_of(self, request: Request) -> Carrier:
        if self._tracer is None:
            return ()
        try:
            return request_parent(request)
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("parent_of")
            return ()

    def pull_finished(self, pull: FinishedPull) -> None:
        """P read D's blocks (or failed to): a CLIENT span from scheduling to the reported completion."""
        if self._tracer is None:
            return
        try:
            attributes = self._pull_attributes(pull.request_id, pull.source_engine, pull.tokens)
            attributes.update(
                {
                    ATTR_PULL_BLOCKS: pull.blocks,
                    tel.ATTR_PULL_BYTES: pull.bytes if not pull.failed else 0,
                    tel.ATTR_PULL_SECONDS: pull.seconds,
                    ATTR_OUTCOME: "failed" if pull.failed else "ok",
                    tel.ATTR_VERDICT: "recompute" if pull.failed else "pulled",
                }
            )
            tel.record_span(
                SPAN_PULL,
                tracer=self._tracer,
                parent=dict(pull.parent),
                kind="client",
                start_time_ns=pull.started_ns,
                end_time_ns=pull.ended_ns,
                attributes=attributes,
                error="NIXL read failed; recomputing" if pull.failed else "",
            )
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("pull_finished")

    def pull_declined(self, request: Request, reason: str, offered_tokens: int) -> None:
        """P was offered D's blocks but reads none (``reason``): an instant span with the decision."""
        if self._tracer is None:
            return
        try:
            params = request.kv_transfer_params or {}
            attributes = self._pull_attributes(
                request.request_id, str(params.get("remote_engine_id", "")), offered_tokens
            )
            attributes.update(
                {
                    ATTR_OUTCOME: "declined",
                    tel.ATTR_VERDICT: "declined",
                    tel.ATTR_REASON: reason,
                    tel.ATTR_PULLED_TOKENS: 0,
                }
            )
            now = time.time_ns()
            tel.record_span(
                SPAN_PULL,
                tracer=self._tracer,
                parent=dict(request_parent(request)),
                start_time_ns=now,
                end_time_ns=now,
                attributes=attributes,
            )
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("pull_declined")

    # ---- control-plane thread --------------------------------------------
    @contextlib.contextmanager
    def registration(
        self,
        request_id: str,
        conversation: ConversationRef,
        *,
        blocks: int,
        tokens: int,
        parent: Carrier,
        submitted_ns: int,
    ) -> Iterator[SpanHandle]:
        """D registering a retained entry (hash chain, GrantLease, RegisterEntry), from the moment it was queued.

        An exception from the body marks the span failed and propagates unchanged.
        """
        if self._tracer is None:
            yield SpanHandle(None, self)
            return
        attributes: dict[str, Any] = {
            tel.ATTR_ENGINE: self._engine_id,
            ATTR_REQUEST: request_id,
            tel.ATTR_MODEL: conversation.model,
            ATTR_EPOCH: conversation.epoch,
            ATTR_RETAINED_BLOCKS: blocks,
            ATTR_RETAINED_TOKENS: tokens,
            ATTR_QUEUED_SECONDS: max(0, time.time_ns() - submitted_ns) / 1e9 if submitted_ns else 0.0,
            **tel.identity_attributes(
                self._hash_key, tenant=conversation.tenant, conversation_key=conversation.conversation_key
            ),
        }
        with self._span(
            SPAN_REGISTER,
            parent=dict(parent),
            attributes=attributes,
            kind="internal",
            start_time_ns=submitted_ns or None,
        ) as handle:
            yield handle

    @contextlib.contextmanager
    def rpc(self, method: str) -> Iterator[SpanHandle]:
        """A CLIENT span around one control-plane RPC (``method`` = "package.Service/Method")."""
        if self._tracer is None:
            yield SpanHandle(None, self)
            return
        service, _, name = method.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        with self._span(method, parent=None, attributes=attributes, kind="client", start_time_ns=None) as handle:
            yield handle

    def rpc_metadata(self) -> Carrier:
        """The current span's trace context for outgoing gRPC metadata (empty when off or outside a span)."""
        if self._tracer is None:
            return ()
        try:
            return tuple(tel.trace_headers().items())
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("rpc_metadata")
            return ()

    def shutdown(self) -> None:
        if self._provider is None:
            return
        try:
            self._provider.shutdown()  # flushes what is queued
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("shutdown")

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        """Exports what is queued (tests, shutdown paths); False when that failed or timed out."""
        if self._provider is None:
            return True
        try:
            return bool(self._provider.force_flush(timeout_ms))
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed("force_flush")
            return False

    # ---- internals -------------------------------------------------------
    def _pull_attributes(self, request_id: str, source_engine: str, tokens: int) -> dict[str, Any]:
        return {
            tel.ATTR_ENGINE: self._engine_id,
            ATTR_REQUEST: request_id,
            ATTR_SOURCE_ENGINE: source_engine,
            tel.ATTR_PULLED_TOKENS: tokens,
        }

    @contextlib.contextmanager
    def _span(
        self,
        name: str,
        *,
        parent: Mapping[str, str] | None,
        attributes: Mapping[str, Any],
        kind: str,
        start_time_ns: int | None,
    ) -> Iterator[SpanHandle]:
        """``tel.start_span`` whose own failures are swallowed; the body's exceptions pass through."""
        if self._tracer is None:
            yield SpanHandle(None, self)
            return
        try:
            manager = tel.start_span(
                name, tracer=self._tracer, parent=parent, attributes=attributes, kind=kind, start_time_ns=start_time_ns
            )
            span = manager.__enter__()
        except Exception:  # noqa: BLE001 - tracing must never break the connector
            self.failed(name)
            yield SpanHandle(None, self)
            return
        try:
            yield SpanHandle(span, self)
        except BaseException as exc:
            self._exit(manager, exc)
            raise
        self._exit(manager, None)

    def _exit(self, manager: contextlib.AbstractContextManager[Any], exc: BaseException | None) -> None:
        try:
            manager.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        except Exception as raised:  # noqa: BLE001 - tracing must never break the connector
            if raised is not exc:
                self.failed("span end")
