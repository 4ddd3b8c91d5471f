"""What every HTTP call from the gateway to an engine shares: its client span, passive health from its
failure, and how a failure reaches the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvbridge import telemetry as tel
from kvbridge.errors import DeadlineExceeded, KvbridgeError, Reason, Unavailable
from kvbridge_services.common.telemetry import server_attributes

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
            attributes={tel.ATTR_ENGINE: engine.engine_id or engine.url, **server_attributes(engine.url)},
        )

    def failed(self, engine: EngineState, exc: UpstreamError, *, client_deadline: bool = False) -> None:
        """Passive health: a timeout ejects the engine for a while, any other transport failure marks it
        down until its next good health check. A timeout under ``client_deadline`` (the client's own, shorter
        than the server's: :func:`client_cut_short`) is the client's choice and says nothing of the engine."""
        if exc.timed_out:
            if not client_deadline:
                self._pool.timed_out(engine)
        elif exc.transport:
            self._pool.mark_failed(engine, str(exc))


def call_timeout_s(turn: Turn, server_s: float) -> float:
    """The deadline of one engine call of a turn: the server's own for the step (``server_s``), or the client's
    ``timeout`` when that is shorter (a client can shorten it, never extend it)."""
    return server_s if turn.timeout_s is None else min(turn.timeout_s, server_s)


def client_cut_short(turn: Turn, server_s: float) -> bool:
    """Whether the turn's engine calls run under the client's deadline, shorter than the server's: their
    expiry is then not the engine's fault (no ejection; a 1 ms timeout must not take engines out of rotation)."""
    return turn.timeout_s is not None and turn.timeout_s < server_s


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
