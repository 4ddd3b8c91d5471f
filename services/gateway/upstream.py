"""HTTP calls to vLLM engines (httpx), each with its own deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx


class UpstreamError(Exception):
    """An engine failed (transport error, timeout, 5xx) or answered something unusable."""

    def __init__(self, message: str, *, status: int = 502, body: Any = None, transport: bool = False,
                 timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.transport = transport
        self.timed_out = timed_out


class ClientError(Exception):
    """The engine rejected the request as the client's fault (4xx): passed through to the client."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


def _body_of(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return {"error": {"message": resp.text[:2000]}}


async def post_json(http: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout_s: float,
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """POST and parse a JSON object; ClientError on 4xx, UpstreamError on anything else unusable.

    ``headers``: extra request headers (the W3C ``traceparent`` of the caller's span).
    """
    try:
        async with asyncio.timeout(timeout_s):
            resp = await http.post(url, json=body, timeout=timeout_s, headers=headers)
    except (httpx.HTTPError, TimeoutError) as exc:
        timed_out = isinstance(exc, TimeoutError | httpx.TimeoutException)
        raise UpstreamError(f"{url}: {type(exc).__name__}: {exc}", transport=True, timed_out=timed_out) from exc
    if 400 <= resp.status_code < 500:
        raise ClientError(resp.status_code, _body_of(resp))
    if resp.status_code != 200:
        raise UpstreamError(f"{url}: HTTP {resp.status_code}", status=resp.status_code, body=_body_of(resp))
    try:
        data = resp.json()
    except ValueError as exc:
        raise UpstreamError(f"{url}: response is not JSON") from exc
    if not isinstance(data, dict):
        raise UpstreamError(f"{url}: response is not a JSON object")
    return data


class UpstreamStream:
    """An open SSE response from an engine; iterate :meth:`chunks` and always :meth:`aclose`."""

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp

    async def chunks(self) -> AsyncIterator[bytes]:
        """Bytes exactly as they arrive (no re-framing, no batching)."""
        async for chunk in self._resp.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self._resp.aclose()


async def open_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], *, connect_timeout_s: float,
                      read_timeout_s: float, headers: Mapping[str, str] | None = None) -> UpstreamStream:
    timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=connect_timeout_s,
                            pool=connect_timeout_s)
    req = http.build_request("POST", url, json=body, timeout=timeout, headers=headers)
    try:
        resp = await http.send(req, stream=True)
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{url}: {type(exc).__name__}: {exc}", transport=True) from exc
    if resp.status_code != 200:
        with contextlib.suppress(httpx.HTTPError):
            await resp.aread()
        await resp.aclose()
        if 400 <= resp.status_code < 500:
            raise ClientError(resp.status_code, _body_of(resp))
        raise UpstreamError(f"{url}: HTTP {resp.status_code}", status=resp.status_code, body=_body_of(resp))
    return UpstreamStream(resp)


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
