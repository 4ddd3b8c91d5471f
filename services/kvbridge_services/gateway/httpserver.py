"""Bounds on slow HTTP clients that uvicorn itself does not set: a deadline for a request's headers and a cap on
their size (docs/gateway.md "Slow clients").

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``, from the end of a response) and, with h11
only, the size of an incomplete event; it has no deadline for headers: a connection that sends nothing, or
part of a request line, is kept for ever. :func:`protocol_class` returns uvicorn's httptools protocol with a
timer armed when a connection opens and when a request's first byte arrives, and cancelled when its headers
are complete; past ``header_timeout_s`` the connection gets a 408 and is closed. Bytes before the end of the
headers are capped at ``MAX_HEADER_BYTES`` (431). The body's deadline is the application's
(``http_api.read_body``), since the body is read by the route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 22\r\nconnection: close\r\n\r\n"
)
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"content-length: 22\r\nconnection: close\r\n\r\n"
)


def protocol_class(
    header_timeout_s: Callable[[], float], on_timeout: Callable[[], None] | None = None
) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with the header deadline, ``header_timeout_s()`` seconds (read per
    connection; None: httptools is not installed, and uvicorn's default protocol is used without it).
    ``on_timeout``: called for each connection closed at the deadline (a metric)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is installed with the services
        log.warning("httptools is not installed: the HTTP door has no header deadline")
        return None

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _kvb_timer: asyncio.TimerHandle | None = None
        _kvb_header_bytes = 0
        _kvb_awaiting_headers = True

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._kvb_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._kvb_disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted only while the headers are still incomplete after this data (a body that came with them
            # is the route's to bound, by max_body_bytes).
            if self._kvb_awaiting_headers and not self.transport.is_closing():
                self._kvb_header_bytes += len(data)
                if self._kvb_header_bytes > MAX_HEADER_BYTES:
                    self._kvb_refuse(_TOO_LARGE + b"headers are too large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._kvb_awaiting_headers = True
            self._kvb_header_bytes = 0
            if self._kvb_timer is None:
                self._kvb_arm()

        def on_headers_complete(self) -> None:
            self._kvb_awaiting_headers = False
            self._kvb_disarm()
            super().on_headers_complete()

        def _kvb_arm(self) -> None:
            self._kvb_disarm()
            self._kvb_awaiting_headers = True
            self._kvb_timer = self.loop.call_later(header_timeout_s(), self._kvb_expired)

        def _kvb_disarm(self) -> None:
            if self._kvb_timer is not None:
                self._kvb_timer.cancel()
                self._kvb_timer = None

        def _kvb_expired(self) -> None:
            self._kvb_timer = None
            if self._kvb_awaiting_headers:
                if on_timeout is not None:
                    on_timeout()
                self._kvb_refuse(_TIMEOUT + b"headers came too late")

        def _kvb_refuse(self, response: bytes) -> None:
            self._kvb_disarm()
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    return HeaderDeadlineProtocol


__all__ = ["MAX_HEADER_BYTES", "protocol_class"]
