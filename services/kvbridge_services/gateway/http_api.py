"""The HTTP front door (starlette): OpenAI chat completions and completions, the OpenAI Responses API and the
Anthropic Messages API (frontdoors.py), every one a turn served by :func:`serve_turn` the same way."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge import telemetry as tel
from kvbridge.errors import InvalidArgument, KvbridgeError, NotFound, Reason, ResourceExhausted
from kvbridge_services.common import authz
from kvbridge_services.common.metric_factory import MetricFactory
from kvbridge_services.common.telemetry import gen_ai_request, gen_ai_usage

from .frontdoors import (
    CHAT_ROW,
    COMPLETION_ROW,
    Failure,
    FrontDoor,
    api_key_or_bearer,
    bearer,
    messages_door,
    messages_error,
    openai_error,
    passthrough,
    responses_door,
    responses_error,
)
from .requests import SESSION_HEADER, parse_json_body, parse_turn
from .responses_store import ResponseStore
from .service import TENANT_HEADER, GatewayCore
from .turnstate import TurnResult
from .upstream import ClientError

REUSE_HEADER = "x-kvbridge-reuse"
PLACEMENT_HEADER = "x-kvbridge-placement"  # <choice>;reason=<why>, with placement on (docs/gateway.md "Placement")


def error_response(err: KvbridgeError) -> JSONResponse:
    """The chat and completions routes' error answer (OpenAI's shape, the machine reason as ``code``)."""
    return openai_error(Failure.of(err))


class BodyTimeout(Exception):
    """The request's body did not arrive within ``body_read_timeout_s``."""


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise InvalidArgument(Reason.TOO_LARGE, f"request body exceeds {limit} bytes", metadata={"field": "body"})
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise InvalidArgument(Reason.TOO_LARGE, f"request body exceeds {limit} bytes", metadata={"field": "body"})
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, within ``timeout_s`` of the headers (a client that sends part of it and then nothing
    holds no slot and no task past it)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise BodyTimeout from None


class FrontDoorMetrics:
    """The HTTP door's own metrics, in the gateway's registry (``/metrics``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        f = MetricFactory(registry)
        self.stored = f.gauge("kvbridge_gateway_stored_responses", "Responses API: stored responses held")
        self.stored_bytes = f.gauge(
            "kvbridge_gateway_stored_response_bytes", "Responses API: bytes charged to the stored responses held"
        )
        self.stored_evicted = f.counter(
            "kvbridge_gateway_stored_responses_evicted_total",
            "Responses API: stored responses evicted by a bound (per tenant or in all), least recently used first",
        )
        self.timeouts = f.counter(
            "kvbridge_gateway_http_timeouts_total",
            "HTTP requests answered 408 because their headers or body did not arrive in time",
            ["phase"],
        )


class TenantSlots:
    """Turns in flight per tenant on the HTTP door, beside the gateway's global count (``core.inflight``)."""

    def __init__(self, core: GatewayCore) -> None:
        self._core = core
        self._by_tenant: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def take(self, tenant: str) -> None:
        s = self._core.settings
        if self._core.inflight >= s.max_concurrency:
            raise ResourceExhausted(
                Reason.OVERLOADED,
                f"too many requests in flight ({s.max_concurrency}, max_concurrency); retry later",
                metadata={"limit": "max_concurrency"},
            )
        held = self._by_tenant.get(tenant, 0)
        if held >= s.max_tenant_concurrency:
            raise ResourceExhausted(
                Reason.OVERLOADED,
                f"this tenant has {held} requests in flight (max_tenant_concurrency); retry later",
                metadata={"limit": "max_tenant_concurrency"},
            )
        self._by_tenant[tenant] = held + 1
        self._core.inflight += 1
        self._core.metrics.inflight.inc()

    def release(self, tenant: str) -> None:
        held = self._by_tenant.get(tenant, 0) - 1
        if held > 0:
            self._by_tenant[tenant] = held
        else:
            self._by_tenant.pop(tenant, None)
        self._core.inflight -= 1
        self._core.metrics.inflight.dec()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request, work: Awaitable[TurnResult]) -> TurnResult | None:
    """Runs ``work`` in this task; cancels it (closing upstream requests) if the client goes away first.

    The work runs in the handler's own task rather than a task of its own: one task and one loop
    iteration less per turn; the disconnect watcher cancels the handler instead.
    """
    handler = asyncio.current_task()
    assert handler is not None
    client_gone = False

    def on_watcher_done(watcher: asyncio.Future[None]) -> None:
        nonlocal client_gone
        if not watcher.cancelled():  # the client disconnected (or the receive channel failed)
            client_gone = True
            handler.cancel()

    watcher = asyncio.ensure_future(_until_disconnect(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if client_gone and handler.uncancel() == 0:
            return None
        raise
    finally:
        watcher.remove_done_callback(on_watcher_done)
        watcher.cancel()


def build_http_app(core: GatewayCore) -> Starlette:
    s = core.settings
    m = core.metrics
    slots = TenantSlots(core)
    door_metrics = FrontDoorMetrics(m.registry)
    store = ResponseStore(
        max_per_tenant=s.stored_responses_per_tenant,
        max_bytes_per_tenant=s.stored_responses_mb_per_tenant * 1024 * 1024,
        max_total_bytes=s.stored_responses_total_mb * 1024 * 1024,
        on_evict=door_metrics.stored_evicted.inc,
    )
    door_metrics.stored.set_function(lambda: float(len(store)))
    door_metrics.stored_bytes.set_function(lambda: float(store.total_bytes))

    Handler = Callable[[Request], Awaitable[Response]]
    tracer = core.telemetry.tracer

    def guarded(
        route: str, handler: Handler, *, traced: bool = False, errors: Callable[[Failure], Response] = openai_error
    ) -> Handler:
        async def wrapper(request: Request) -> Response:
            if not traced:
                return await measured(request)
            # The root of the turn's trace, or a child of the caller's (W3C traceparent, e.g. from Envoy).
            parent = tel.extract(dict(request.headers)) if tel.TRACEPARENT in request.headers else None
            span = tracer.start_span(
                f"{request.method} {request.url.path}",
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={
                    "http.request.method": request.method,
                    "url.path": request.url.path,
                    "http.route": request.url.path,
                },
            )
            try:
                with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                    resp = await measured(request)
            except BaseException:
                span.end()
                raise
            span.set_attribute("http.response.status_code", resp.status_code)
            if resp.status_code >= 500:
                span.set_status(trace.Status(trace.StatusCode.ERROR))
            if isinstance(resp, StreamingResponse):  # the request lasts until its stream ends
                resp.body_iterator = _ending(resp.body_iterator, span)
            else:
                span.end()
            return resp

        async def measured(request: Request) -> Response:
            started = time.perf_counter()
            try:
                resp = await handler(request)
            except KvbridgeError as err:
                resp = errors(Failure.of(err))
            except BodyTimeout:
                door_metrics.timeouts.labels("body").inc()
                message = f"the request body did not arrive within {s.body_read_timeout_s:g} s"
                resp = errors(Failure(408, message, "request_timeout", "body", close=True))
            except ClientDisconnect:
                resp = Response(status_code=499)
            m.requests.labels(route, f"{resp.status_code // 100}xx").inc()
            m.latency.labels(route).observe(time.perf_counter() - started)
            return resp

        return wrapper

    async def serve_turn(request: Request, door: FrontDoor) -> Response:
        """One turn through any front door: authenticate, authorize (the door's row), read the body (bounded in
        size and time), translate it, take a slot (global and per tenant), run the router, answer in the door's
        API with the verdict header; the slot is held until the answer (or its stream) ends."""
        principal = core.auth.authenticate_key(door.credentials(request))
        authz.require(principal, door.row)  # the same row as the gRPC method
        tenant = core.tenant_of(principal, request.headers.get(TENANT_HEADER))
        body = parse_json_body(await read_body(request, s.max_body_bytes, s.body_read_timeout_s))
        exchange = door.prepare(body, request, tenant)
        turn = parse_turn(
            door.kind,
            exchange.turn_body,
            tenant=tenant,
            session_header=request.headers.get(SESSION_HEADER),
            limits=core.limits,
        )
        slots.take(tenant)
        release = True
        try:
            result = await _race_disconnect(request, core.router.run(turn))
            if result is None:
                return Response(status_code=499)
            headers = {REUSE_HEADER: result.verdict.header()}
            if result.verdict.placement:
                headers[PLACEMENT_HEADER] = result.verdict.placement
            span = trace.get_current_span()  # the HTTP request's: gen_ai.* on it too (a stream's usage at its end)
            span.set_attributes(gen_ai_request(door.kind, turn.model))
            if result.stream is not None:
                release = False
                if span.is_recording():
                    result.stream = _usage_observed(result.stream, span)
                return StreamingResponse(
                    _release_after(result, exchange.stream(result.stream), lambda: slots.release(tenant)),
                    media_type="text/event-stream",
                    headers={**headers, "cache-control": "no-cache"},
                )
            assert result.body is not None
            span.set_attributes(gen_ai_usage(result.body.get("usage")))
            return JSONResponse(
                exchange.answer(result.body), headers=headers, background=BackgroundTask(_finish, result)
            )
        except ClientError as exc:
            return door.error(Failure.engine(exc.status, exc.body))
        finally:
            if release:
                slots.release(tenant)

    def door_route(path: str, door: FrontDoor) -> Route:
        async def handler(request: Request) -> Response:
            return await serve_turn(request, door)

        return Route(path, guarded(door.route, handler, traced=True, errors=door.error), methods=["POST"])

    doors = {
        "/v1/chat/completions": FrontDoor("chat", "chat", CHAT_ROW, bearer, passthrough, openai_error),
        "/v1/completions": FrontDoor("completions", "completion", COMPLETION_ROW, bearer, passthrough, openai_error),
        # The Responses and Messages APIs are chat turns: they answer under the chat completion's row.
        "/v1/responses": FrontDoor("responses", "chat", CHAT_ROW, bearer, responses_door(store), responses_error),
        "/v1/messages": FrontDoor("messages", "chat", CHAT_ROW, api_key_or_bearer, messages_door, messages_error),
    }

    async def get_response(request: Request) -> Response:
        principal = core.auth.authenticate_key(bearer(request))
        authz.require(principal, CHAT_ROW)
        tenant = core.tenant_of(principal, request.headers.get(TENANT_HEADER))
        response_id = request.path_params["response_id"]
        stored = store.get(tenant, response_id)
        if stored is None:
            raise NotFound("not_found", f"Response with id '{response_id}' not found.", metadata={"field": "id"})
        return JSONResponse(stored.response)

    async def delete_response(request: Request) -> Response:
        principal = core.auth.authenticate_key(bearer(request))
        authz.require(principal, CHAT_ROW)
        tenant = core.tenant_of(principal, request.headers.get(TENANT_HEADER))
        response_id = request.path_params["response_id"]
        if not store.delete(tenant, response_id):
            raise NotFound("not_found", f"Response with id '{response_id}' not found.", metadata={"field": "id"})
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def models(request: Request) -> Response:
        authz.require(core.auth.authenticate_key(bearer(request)), "kvbridge.gateway.v1.GatewayService/ListModels")
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvbridge"} for name in sorted(core.models())]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})  # /healthz and vLLM's /health: the process is up

    async def readyz(_: Request) -> Response:
        ready = core.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def metrics(_: Request) -> Response:
        core.update_engine_gauges()
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    routes = [
        *(door_route(path, door) for path, door in doors.items()),
        Route(
            "/v1/responses/{response_id}",
            guarded("responses_get", get_response, errors=responses_error),
            methods=["GET"],
        ),
        Route(
            "/v1/responses/{response_id}",
            guarded("responses_delete", delete_response, errors=responses_error),
            methods=["DELETE"],
        ),
        Route("/v1/models", guarded("models", models), methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_exception, Exception: _internal_error},  # type: ignore[dict-item]
    )
    app.state.responses = store  # the stored responses (tests read them)
    app.state.slots = slots
    app.state.metrics = door_metrics
    return app


def _error_shape(path: str) -> Callable[[Failure], Response]:
    """The error shape of a path: the Messages API's under ``/v1/messages``, OpenAI's everywhere else."""
    return messages_error if path == "/v1/messages" or path.startswith("/v1/messages/") else openai_error


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """The router's own answers (no such path: 404, a path without that method: 405) in the path's API shape,
    as JSON (Starlette's are text/plain)."""
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        failure = Failure(404, f"Invalid URL ({method} {path})", "not_found")
    elif exc.status_code == 405:
        failure = Failure(405, f"Method {method} is not allowed on {path}", "method_not_allowed")
    else:
        failure = Failure(exc.status_code, str(exc.detail))
    resp = _error_shape(path)(failure)
    for name, value in (exc.headers or {}).items():  # the 405's Allow
        resp.headers[name] = value
    return resp


async def _internal_error(request: Request, _exc: Exception) -> Response:
    """An unexpected failure (logged by Starlette with its traceback) as a JSON 500 in the path's API shape."""
    return _error_shape(request.url.path)(Failure(500, "internal error", "internal"))


async def _ending(body: AsyncIterable[Any], span: trace.Span) -> AsyncIterator[Any]:
    """A streamed answer's body; its request's span ends with it."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()


def _usages(chunk: bytes) -> list[dict[str, Any]]:
    """The ``usage`` objects of a chunk of D's SSE (whole frames: decode.forward holds a frame until its end)."""
    out: list[dict[str, Any]] = []
    for event in chunk.split(b"\n\n"):
        data = event.strip()
        if b'"completion_tokens"' not in data or not data.startswith(b"data:"):
            continue
        try:
            usage = json.loads(data[5:]).get("usage")
        except (ValueError, AttributeError):
            continue
        if isinstance(usage, dict):
            out.append(usage)
    return out


async def _usage_observed(stream: AsyncIterator[bytes], span: trace.Span) -> AsyncIterator[bytes]:
    """D's SSE as it is, its usage frame (when the stream has one: the client's ``stream_options.include_usage``,
    always for the Responses and Messages APIs) written to ``span`` as gen_ai.usage.*."""
    try:
        async for chunk in stream:
            if b'"completion_tokens"' in chunk:
                for usage in _usages(chunk):
                    span.set_attributes(gen_ai_usage(usage))
            yield chunk
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


async def _finish(result: TurnResult) -> None:
    """Post-turn work, once the response is sent (async, so Starlette runs it in the loop, not a thread)."""
    result.finish()


async def _release_after(
    result: TurnResult, translated: AsyncIterator[bytes], release: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The answer's stream (D's, or translated from it); at its end, or the client's going, the upstream request
    is closed, the slot released and the post-turn work started."""
    upstream = result.stream
    assert upstream is not None
    try:
        async for chunk in translated:
            yield chunk
    finally:
        for stream in (translated, upstream):
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        release()
        result.finish()


__all__ = ["build_http_app", "error_response", "REUSE_HEADER"]
