"""HTTP calls to vLLM engines, each with its own deadline.

One pooled aiohttp session per gateway. aiohttp rather than httpx: on the turn path
(tokenize, prefill, decode: three engine calls per turn) it costs about a quarter of
httpx's CPU per request here (0.15 ms vs 0.58 ms measured against the engine
simulator), and its connection pool picks a connection in O(1) where httpcore scans
every pooled connection per request (bench/results/gateway.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .jsoncodec import dumps, loads_engine

log = logging.getLogger(__name__)

# (method, url, headers) of each request the gateway sends to an engine.
RequestObserver = Callable[[str, str, Mapping[str, str]], None]

# Errors an engine call can end in: transport, protocol, and deadline.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)


def connection_refused(exc: BaseException) -> bool:
    """Whether no connection could be made (refused, unreachable): the engine process may be gone. A timeout, an
    error status or a dropped keep-alive connection (the server closing an idle one) come from a live process."""
    return isinstance(exc, aiohttp.ClientConnectorError)


class UpstreamError(Exception):
    """An engine failed (transport error, timeout, 5xx) or answered something unusable.

    Its message reaches tenants (a 502/504's message: ``upstream_failure``), so it never names the engine: no URL,
    host or port, nor the transport's own error text (aiohttp's names the address). ``detail`` has them, for logs
    (each failure is logged once, at WARNING, where it is raised)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        body: Any = None,
        transport: bool = False,
        timed_out: bool = False,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.transport = transport
        self.timed_out = timed_out
        self.detail = detail or message


def _failed(url: str, message: str, detail: str, **kw: Any) -> UpstreamError:
    """An UpstreamError whose message names no engine; the URL and the cause go to the log."""
    log.warning("engine call to %s failed: %s", url, detail)
    return UpstreamError(message, detail=f"{url}: {detail}", **kw)


def _transport_failure(url: str, exc: BaseException) -> UpstreamError:
    timed_out = isinstance(exc, TimeoutError)
    if timed_out:
        message = "the engine did not answer in time"
    elif connection_refused(exc):
        message = "the engine could not be reached"
    else:
        message = "the connection to the engine failed"
    return _failed(url, message, f"{type(exc).__name__}: {exc}", transport=True, timed_out=timed_out)


class ClientError(Exception):
    """The engine rejected the request as the client's fault (4xx): passed through to the client."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Reply:
    """A small, fully read engine response (health, models, metrics)."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def _body_of(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"error": {"message": raw[:2000].decode("utf-8", "replace")}}


_IDLE_KEEPALIVE_S = 4.0


def _json_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {**(headers or {}), "Content-Type": "application/json"}


class EngineHttp:
    """The gateway's HTTP client to its engines: one keep-alive pool, a deadline on every call.

    The session is created on first use, inside the running event loop.
    ``observers`` see every outbound request (method, url, headers); tests use them to
    check what really goes to an engine.
    """

    def __init__(self, *, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.observers: list[RequestObserver] = []

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle connections are dropped before the engine's server drops them (uvicorn's and vLLM's
            # keep-alive timeout is 5 s): reusing one the server just closed fails the request.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_IDLE_KEEPALIVE_S, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, raise_for_status=False)
        return self._session

    def _observe(self, method: str, url: str, headers: Mapping[str, str] | None) -> None:
        for observer in self.observers:
            observer(method, url, dict(headers or {}))

    async def get(self, url: str, *, timeout_s: float) -> Reply:
        """GET and read the whole body; raises ``TRANSPORT_ERRORS`` on failure or deadline."""
        self._observe("GET", url, None)
        async with asyncio.timeout(timeout_s):
            async with self._http().get(url) as resp:
                return Reply(resp.status, await resp.read())

    async def post_json(
        self, url: str, body: dict[str, Any], *, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """POST and parse a JSON object; ClientError on 4xx, UpstreamError on anything else unusable.

        ``headers``: extra request headers (the W3C ``traceparent`` of the caller's span).
        """
        self._observe("POST", url, headers)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._http().post(url, data=dumps(body), headers=_json_headers(headers)) as resp:
                    status, raw = resp.status, await resp.read()
        except TRANSPORT_ERRORS as exc:
            raise _transport_failure(url, exc) from exc
        if 400 <= status < 500:
            raise ClientError(status, _body_of(raw))
        if status != 200:
            raise _failed(
                url, f"the engine answered HTTP {status}", f"HTTP {status}", status=status, body=_body_of(raw)
            )
        try:
            data = loads_engine(raw)
        except ValueError as exc:
            raise _failed(url, "the engine's response is not JSON", "response is not JSON") from exc
        if not isinstance(data, dict):
            raise _failed(url, "the engine's response is not a JSON object", "response is not a JSON object")
        return data

    async def open_stream(
        self,
        url: str,
        body: dict[str, Any],
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamStream:
        """Start a streamed POST; the read timeout bounds each wait for the next bytes."""
        self._observe("POST", url, headers)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        try:
            resp = await self._http().post(url, data=dumps(body), headers=_json_headers(headers), timeout=timeout)
        except TRANSPORT_ERRORS as exc:
            raise _transport_failure(url, exc) from exc
        if resp.status != 200:
            raw = b""
            with contextlib.suppress(*TRANSPORT_ERRORS):
                raw = await resp.read()
            resp.release()
            if 400 <= resp.status < 500:
                raise ClientError(resp.status, _body_of(raw))
            raise _failed(
                url,
                f"the engine answered HTTP {resp.status}",
                f"HTTP {resp.status}",
                status=resp.status,
                body=_body_of(raw),
            )
        return UpstreamStream(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class UpstreamStream:
    """An open SSE response from an engine; iterate :meth:`chunks` and always :meth:`aclose`."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def chunks(self) -> AsyncIterator[bytes]:
        """Bytes exactly as they arrive (no re-framing, no batching)."""
        async for chunk in self._resp.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        # Closing (not releasing) drops the connection when the body was not read to the end:
        # the engine sees the disconnect and aborts the request.
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any] | None]:
    """Parses SSE ``data:`` events into JSON objects; None marks ``[DONE]``. (gRPC front door only.)"""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            if data.strip() == b"[DONE]":
                yield None
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj
