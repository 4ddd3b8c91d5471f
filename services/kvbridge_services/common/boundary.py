"""Error translation at the gRPC boundary: the one place exceptions become statuses.

Servicer methods raise ``kvbridge.errors.KvbridgeError`` (or let a
``StoreError`` escape); ``rpc_boundary`` / ``stream_boundary`` turn it into a
gRPC status with ``google.rpc.ErrorInfo``. Anything unexpected is logged with
its traceback and becomes INTERNAL without leaking details to the caller.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvbridge.errors import Internal, KvbridgeError, Reason, Unavailable

from .store.base import StoreError, StoreNoSpace, StoreUnavailable

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def translate(exc: BaseException) -> KvbridgeError:
    if isinstance(exc, KvbridgeError):
        return exc
    if isinstance(exc, StoreNoSpace):
        # UNAVAILABLE, as any store outage (callers fail open on it), with the cause as its reason.
        return Unavailable(
            Reason.STORE_NO_SPACE,
            "the store (etcd) is out of space (NOSPACE alarm) and refuses writes; nothing was written; "
            "reads still answer; retry later",
        )
    if isinstance(exc, StoreUnavailable | TimeoutError):
        return Unavailable(Reason.STORE_UNAVAILABLE, "the backing store did not answer in time; retry")
    if isinstance(exc, StoreError):
        return Unavailable(Reason.STORE_UNAVAILABLE, f"store error: {type(exc).__name__}")
    log.exception("internal error", exc_info=exc)
    return Internal("", "internal error")


def rpc_boundary(
    method: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            await context.abort_with_status(translate(exc).to_status())
            raise AssertionError("unreachable") from None

    return wrapper


def stream_boundary(
    method: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Resp]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Resp]:
        try:
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            await context.abort_with_status(translate(exc).to_status())

    return wrapper
