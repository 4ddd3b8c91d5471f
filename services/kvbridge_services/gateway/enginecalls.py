"""What every HTTP call from the gateway to an engine shares: its client span, passive health from its
failure, and how a failure reaches the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvbridge import telemetry as tel
from kvbridge.errors import DeadlineExceeded, KvbridgeError, Reason, Unavailable

from .config import GatewaySettings
from .engines import EnginePool, EngineState
from .metrics import GatewayMetrics
from .turn import Turn
from .upstream import EngineHttp, UpstreamError


class EngineCalls:
    def __init__(self, pool: EnginePool, tracer: trace.Tracer) -> None:
        self._pool = pool
        self._tracer = tracer

    def span(self, name: str, engine: EngineState) -> Any:
        """A CLIENT span around one HTTP call to an engine (its traceparent goes into the request headers)."""
        return self._tracer.start_as_current_span(
            name,
            kind=trace.SpanKind.CLIENT,
            attributes={tel.ATTR_ENGINE: engine.engine_id or engine.url, "server.address": engine.url},
        )

    def failed(self, engine: EngineState, exc: UpstreamError) -> None:
        """Passive health: a timeout ejects the engine for a while, any other transport failure marks it
        down until its next good health check."""
        if exc.timed_out:
            self._pool.timed_out(engine)
        elif exc.transport:
            self._pool.mark_failed(engine, str(exc))


def completion_path(turn: Turn) -> str:
    return "/v1/chat/completions" if turn.kind == "chat" else "/v1/completions"


def upstream_failure(step: str, exc: UpstreamError) -> KvbridgeError:
    """An engine past its deadline is DEADLINE_EXCEEDED (HTTP 504); any other failure UNAVAILABLE (502)."""
    if exc.timed_out:
        return DeadlineExceeded(Reason.UPSTREAM_FAILED, f"{step} timed out: {exc}")
    return Unavailable(Reason.UPSTREAM_FAILED, f"{step} failed: {exc}")


@dataclass(frozen=True, slots=True)
class EngineAccess:
    """What every step of a turn that calls engines is given (prompt ids, prefill, decode)."""

    settings: GatewaySettings
    pool: EnginePool
    http: EngineHttp
    calls: EngineCalls
    metrics: GatewayMetrics


class EngineStep:
    """Base of those steps: their engine access, unpacked once."""

    def __init__(self, access: EngineAccess) -> None:
        self._s = access.settings
        self._pool = access.pool
        self._http = access.http
        self._calls = access.calls
        self._metrics = access.metrics
