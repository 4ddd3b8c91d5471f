"""OpenAI-compatible HTTP front door (starlette)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge import telemetry as tel
from kvbridge.errors import InvalidArgument, KvbridgeError, Reason, ResourceExhausted
from kvbridge_services.common import authz

from .requests import SESSION_HEADER, parse_json_body, parse_turn
from .service import TENANT_HEADER, GatewayCore
from .turn import TurnKind
from .turnstate import TurnResult
from .upstream import ClientError

REUSE_HEADER = "x-kvbridge-reuse"
PLACEMENT_HEADER = "x-kvbridge-placement"  # <choice>;reason=<why>, with placement on (docs/gateway.md "Placement")
# The HTTP routes answer under the authorization rows of their gRPC twins (kvbridge_services.common.authz).
_HTTP_METHODS: dict[TurnKind, str] = {
    "chat": "kvbridge.gateway.v1.GatewayService/CreateChatCompletion",
    "completion": "kvbridge.gateway.v1.GatewayService/CreateCompletion",
}

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_response(err: KvbridgeError) -> JSONResponse:
    status = _HTTP_STATUS.get(err.code, 500)
    if err.reason == Reason.TOO_LARGE.value:
        status = 413
    elif err.reason == Reason.UPSTREAM_FAILED.value and err.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
        status = 502  # an engine failed; one that timed out keeps 504
    body = {
        "error": {
            "message": err.message,
            "type": err.code.name.lower(),
            "code": err.reason or None,
            "param": err.metadata.get("field"),
        }
    }
    return JSONResponse(body, status_code=status)


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if value is None:
        return None
    if not value.lower().startswith("bearer "):
        return ""
    return value[7:].strip()


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

    Handler = Callable[[Request], Awaitable[Response]]
    tracer = core.telemetry.tracer

    def guarded(route: str, handler: Handler, *, traced: bool = False) -> Handler:
        async def wrapper(request: Request) -> Response:
            if not traced:
                return await measured(request)
            # The root of the turn's trace, or a child of the caller's (W3C traceparent, e.g. from Envoy).
            parent = tel.extract(dict(request.headers)) if tel.TRACEPARENT in request.headers else None
            with tracer.start_as_current_span(
                f"{request.method} {request.url.path}",
                context=parent,
                kind=trace.SpanKind.SERVER,
                record_exception=False,
                set_status_on_exception=False,
                attributes={
                    "http.request.method": request.method,
                    "url.path": request.url.path,
                    "http.route": request.url.path,
                },
            ) as span:
                resp = await measured(request)
                span.set_attribute("http.response.status_code", resp.status_code)
                if resp.status_code >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
                return resp

        async def measured(request: Request) -> Response:
            started = time.perf_counter()
            try:
                resp = await handler(request)
            except KvbridgeError as err:
                resp = error_response(err)
            except ClientDisconnect:
                resp = Response(status_code=499)
            m.requests.labels(route, f"{resp.status_code // 100}xx").inc()
            m.latency.labels(route).observe(time.perf_counter() - started)
            return resp

        return wrapper

    async def completion(request: Request, kind: TurnKind) -> Response:
        principal = core.auth.authenticate_key(_bearer(request))
        authz.require(principal, _HTTP_METHODS[kind])  # the same row as the gRPC method
        if core.inflight >= s.max_concurrency:
            raise ResourceExhausted(Reason.OVERLOADED, "too many requests in flight; retry later")
        core.inflight += 1
        m.inflight.inc()
        release = True
        try:
            body = parse_json_body(await _read_body(request, s.max_body_bytes))
            tenant = core.tenant_of(principal, request.headers.get(TENANT_HEADER))
            turn = parse_turn(
                kind, body, tenant=tenant, session_header=request.headers.get(SESSION_HEADER), limits=core.limits
            )
            result = await _race_disconnect(request, core.router.run(turn))
            if result is None:
                return Response(status_code=499)
            headers = {REUSE_HEADER: result.verdict.header()}
            if result.verdict.placement:
                headers[PLACEMENT_HEADER] = result.verdict.placement
            if result.stream is not None:
                release = False
                return StreamingResponse(
                    _release_after(result, core),
                    media_type="text/event-stream",
                    headers={**headers, "cache-control": "no-cache"},
                )
            return JSONResponse(result.body, headers=headers, background=BackgroundTask(_finish, result))
        except ClientError as exc:
            return JSONResponse(exc.body, status_code=exc.status)
        finally:
            if release:
                core.inflight -= 1
                m.inflight.dec()

    async def chat(request: Request) -> Response:
        return await completion(request, "chat")

    async def completions(request: Request) -> Response:
        return await completion(request, "completion")

    async def models(request: Request) -> Response:
        authz.require(core.auth.authenticate_key(_bearer(request)), "kvbridge.gateway.v1.GatewayService/ListModels")
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvbridge"} for name in sorted(core.models())]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        ready = core.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def metrics(_: Request) -> Response:
        core.update_engine_gauges()
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", guarded("chat", chat, traced=True), methods=["POST"]),
        Route("/v1/completions", guarded("completions", completions, traced=True), methods=["POST"]),
        Route("/v1/models", guarded("models", models), methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)


async def _finish(result: TurnResult) -> None:
    """Post-turn work, once the response is sent (async, so Starlette runs it in the loop, not a thread)."""
    result.finish()


async def _release_after(result: TurnResult, core: GatewayCore) -> AsyncIterator[bytes]:
    stream = result.stream
    assert stream is not None
    try:
        async for chunk in stream:
            yield chunk
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
        core.inflight -= 1
        core.metrics.inflight.dec()
        result.finish()


__all__ = ["build_http_app", "error_response", "REUSE_HEADER"]
