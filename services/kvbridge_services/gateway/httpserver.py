"""Bounds on slow HTTP clients that uvicorn itself does not set: a deadline for a request's headers and a cap on
their size (docs/gateway.md "Slow clients").

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``, from the end of a response) and, with h11
only, the size of an incomplete event; it has no deadline for headers: a connection that sends nothing, or
part of a request line, is kept for ever. :func:`protocol_class` returns uvicorn's HTTP protocol (httptools
when installed, else h11) with a timer armed when a connection opens and when a request's first byte arrives,
and cancelled when its headers are complete; past ``header_timeout_s`` the connection gets a 408 and is
closed. With httptools, bytes before the end of the headers are capped at ``MAX_HEADER_BYTES`` (431; h11 has
its own cap, ``h11_max_incomplete_event_size``). The body's deadline is the application's
(``http_api.read_body``), since the body is read by the route.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 64 * 1024


def _refusal(status: str, text: str, code: str) -> bytes:
    """A refusal before the request's path is known: JSON in OpenAI's error shape (docs/gateway.md "Errors")."""
    error = {"message": text, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT = _refusal("408 Request Timeout", "headers came too late", "request_timeout")
_TOO_LARGE = _refusal("431 Request Header Fields Too Large", "headers are too large", "headers_too_large")


class _Deadline:
    """The header timer of one connection."""

    def __init__(self, transport: Any, timeout_s: float, on_timeout: Callable[[], None] | None) -> None:
        self._transport = transport
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._on_timeout is not None:
            self._on_timeout()
        refuse(self._transport, _TIMEOUT)


def refuse(transport: Any, response: bytes) -> None:
    if not transport.is_closing():
        transport.write(response)
        transport.close()


def protocol_class(
    header_timeout_s: Callable[[], float],
    on_timeout: Callable[[], None] | None = None,
    *,
    impl: Literal["auto", "httptools", "h11"] = "auto",
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the header deadline, ``header_timeout_s()`` seconds (read per connection).
    ``on_timeout``: called for each connection closed at the deadline (a metric). ``impl``: uvicorn's
    httptools protocol (``auto``: when installed) or its h11 one."""
    if impl != "h11":
        try:
            return _httptools_class(header_timeout_s, on_timeout)
        except ImportError:
            if impl == "httptools":
                raise
    return _h11_class(header_timeout_s, on_timeout)


def _httptools_class(
    header_timeout_s: Callable[[], float], on_timeout: Callable[[], None] | None
) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderDeadlineHttpTools(HttpToolsProtocol):
        _kvb_deadline: _Deadline
        _kvb_header_bytes = 0
        _kvb_awaiting_headers = True

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._kvb_deadline = _Deadline(transport, header_timeout_s(), on_timeout)
            self._kvb_deadline.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._kvb_deadline.disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted only while the headers are still incomplete after this data (a body that came with them
            # is the route's to bound, by max_body_bytes).
            if self._kvb_awaiting_headers and not self.transport.is_closing():
                self._kvb_header_bytes += len(data)
                if self._kvb_header_bytes > MAX_HEADER_BYTES:
                    self._kvb_deadline.disarm()
                    refuse(self.transport, _TOO_LARGE)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._kvb_awaiting_headers = True
            self._kvb_header_bytes = 0
            if not self._kvb_deadline.armed:
                self._kvb_deadline.arm()

        def on_headers_complete(self) -> None:
            self._kvb_awaiting_headers = False
            self._kvb_deadline.disarm()
            super().on_headers_complete()

    return HeaderDeadlineHttpTools


def _h11_class(header_timeout_s: Callable[[], float], on_timeout: Callable[[], None] | None) -> type[asyncio.Protocol]:
    class HeaderDeadlineH11(H11Protocol):
        """h11 emits a request once its headers are complete: until then the client's state is IDLE."""

        _kvb_deadline: _Deadline

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._kvb_deadline = _Deadline(transport, header_timeout_s(), on_timeout)
            self._kvb_deadline.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._kvb_deadline.disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._kvb_deadline.armed and self.conn.their_state is h11.IDLE:
                self._kvb_deadline.arm()  # a keep-alive connection's next request began
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._kvb_deadline.disarm()

    return HeaderDeadlineH11


__all__ = ["MAX_HEADER_BYTES", "protocol_class"]
