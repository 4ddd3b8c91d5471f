"""Malformed requests become INVALID_ARGUMENT with a reason, not grpc's bare UNKNOWN.

grpc-python answers a request that fails to parse (corrupt wire format, a string field with invalid UTF-8)
with UNKNOWN and no ErrorInfo. This interceptor swaps each method's deserializer for one that returns a
marker instead of raising, and makes the method answer INVALID_ARGUMENT (reason INVALID_FIELD) for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvbridge.errors import InvalidArgument, Reason

from .handler_cache import WrappingInterceptor

Ctx = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True, slots=True)
class _Malformed:
    detail: str


def _error(marker: _Malformed) -> InvalidArgument:
    return InvalidArgument(
        Reason.INVALID_FIELD, f"malformed request message: {marker.detail}", metadata={"field": "request"}
    )


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's fault
            return _Malformed(str(exc)[:200])

    return parse


def _unary_request(inner: Callable[[Any, Ctx], Any], streaming_response: bool) -> Callable[[Any, Ctx], Any]:
    if streaming_response:

        async def stream_behavior(request: Any, context: Ctx) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort_with_status(_error(request).to_status())
            result = inner(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result

        return stream_behavior

    async def unary_behavior(request: Any, context: Ctx) -> Any:
        if isinstance(request, _Malformed):
            await context.abort_with_status(_error(request).to_status())
        return await inner(request, context)

    return unary_behavior


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream that raises (for the servicer's boundary to translate) at the first malformed message."""
    async for request in requests:
        if isinstance(request, _Malformed):
            raise _error(request)
        yield request


def _stream_request(inner: Callable[[Any, Ctx], Any], streaming_response: bool) -> Callable[[Any, Ctx], Any]:
    """The wrapper must itself be a coroutine / async generator function: grpc.aio picks how to run a handler
    from its kind, and runs a plain function as a sync one (iterating an async generator -> UNKNOWN)."""
    if streaming_response:

        async def stream_behavior(requests: AsyncIterator[Any], context: Ctx) -> AsyncIterator[Any]:
            result = inner(_checked(requests), context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:  # a handler writing with context.write() and returning None
                await result

        return stream_behavior

    async def unary_behavior(requests: AsyncIterator[Any], context: Ctx) -> Any:
        return await inner(_checked(requests), context)

    return unary_behavior


class DecodeGuardInterceptor(WrappingInterceptor):
    def __init__(self) -> None:
        super().__init__(_guarded)


def _guarded(method: str, h: Any) -> Any:
    deserializer = _tolerant(h.request_deserializer)
    if h.unary_unary is not None:
        return h._replace(request_deserializer=deserializer, unary_unary=_unary_request(h.unary_unary, False))
    if h.unary_stream is not None:
        return h._replace(request_deserializer=deserializer, unary_stream=_unary_request(h.unary_stream, True))
    if h.stream_unary is not None:
        return h._replace(request_deserializer=deserializer, stream_unary=_stream_request(h.stream_unary, False))
    if h.stream_stream is not None:
        return h._replace(request_deserializer=deserializer, stream_stream=_stream_request(h.stream_stream, True))
    return h
