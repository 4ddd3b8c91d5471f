"""Slow clients on the HTTP door (issue 30, item 4), with real sockets on loopback against a real gateway and the
engine simulators: a client that sends headers and part of a body, then nothing, holds no concurrency slot and
is answered 408 at the body deadline; a connection that never finishes its headers is closed at the header
deadline; a tenant's turns in flight are capped so that another tenant's still run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Literal

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvbridge_services.gateway.httpserver import protocol_class
from tests.fixtures.gateway_stack import LONG, chat

from .conftest import Stack

SLOW_CLIENTS = 500


@contextlib.asynccontextmanager
async def _slow_clients(
    stack: Stack, count: int, payload: bytes
) -> AsyncIterator[list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    host, port = stack.gateway.http_url.removeprefix("http://").split(":")
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(count):
            reader, writer = await asyncio.open_connection(host, int(port))
            if payload:
                writer.write(payload)
            conns.append((reader, writer))
        await asyncio.gather(*(w.drain() for _, w in conns))
        yield conns
    finally:
        for _, writer in conns:
            writer.close()
        for _, writer in conns:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _partial_body(key: str) -> bytes:
    body = json.dumps(chat([{"role": "user", "content": LONG}], conv=None)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body[: len(body) // 2]


def _timeouts(stack: Stack, phase: str) -> float | None:
    return stack.gateway.core.metrics.registry.get_sample_value(
        "kvbridge_gateway_http_timeouts_total", {"phase": phase}
    )


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    async with asyncio.timeout(30):
        return await reader.read()


async def test_slow_bodies_hold_no_slot_and_get_408(stack: Stack) -> None:
    settings = stack.gateway.settings
    settings.body_read_timeout_s = 3.0
    async with (
        _slow_clients(stack, SLOW_CLIENTS, _partial_body("key-acme")) as conns,
        httpx.AsyncClient(
            base_url=stack.gateway.http_url, headers={"authorization": "Bearer key-globex"}, timeout=30
        ) as globex,
    ):
        # Every slow client is inside the gateway, waiting for the rest of its body, and holds no slot.
        assert stack.gateway.core.inflight == 0
        r = await globex.post("/v1/chat/completions", json=chat([{"role": "user", "content": LONG}], conv="g-1"))
        assert r.status_code == 200, r.text
        acme = await stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}]))
        assert acme.status_code == 200, acme.text  # the slow clients' own tenant too: they hold nothing
        answers = await asyncio.gather(*(_answer(reader) for reader, _ in conns))
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}
    head, _, body = answers[0].partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "3 s" in error["message"]
    assert stack.gateway.core.inflight == 0
    assert _timeouts(stack, "body") == SLOW_CLIENTS


@pytest.mark.parametrize("payload", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"])
async def test_incomplete_headers_are_closed_at_the_header_deadline(stack: Stack, payload: bytes) -> None:
    stack.gateway.settings.header_timeout_s = 1.0
    async with _slow_clients(stack, 50, payload) as conns:
        answers = await asyncio.gather(*(_answer(reader) for reader, _ in conns))
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}
    assert _timeouts(stack, "headers") == 50
    r = await stack.client.get("/v1/models")  # a complete request is not affected
    assert r.status_code == 200


async def test_oversized_headers_get_431(stack: Stack) -> None:
    async with _slow_clients(stack, 1, b"GET /v1/models HTTP/1.1\r\nx-junk: " + b"a" * 70_000) as conns:
        answer = await _answer(conns[0][0])
    assert answer.startswith(b"HTTP/1.1 431 ")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head  # OpenAI's error shape, as every route's (issue 31)
    assert json.loads(body)["error"] == {
        "message": "headers are too large",
        "type": "invalid_request_error",
        "param": None,
        "code": "headers_too_large",
    }


async def test_a_large_body_sent_with_its_headers_is_not_a_large_header(stack: Stack) -> None:
    # Padded where the prompt does not grow (the simulator's context is short): OpenAI's "user" field.
    body = json.dumps(chat([{"role": "user", "content": LONG}], conv=None, user="u" * 200_000)).encode()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer key-acme\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body
    assert len(body) > 128 * 1024
    async with _slow_clients(stack, 1, request) as conns:  # one write: headers and body in the same segments
        answer = await _answer(conns[0][0])
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


async def test_a_tenant_at_its_limit_gets_429_and_others_go_on(stack: Stack) -> None:
    stack.gateway.settings.max_tenant_concurrency = 1
    stack.decode.cfg.stall_s = 30.0  # acme's first turn stays in flight
    stack.decode.cfg.stall_after_tokens = 1
    d = stack.decode.engine.stats
    first = asyncio.create_task(
        stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": LONG}]))
    )
    try:
        async with asyncio.timeout(10):
            while d.stalled < 1:  # noqa: ASYNC110 - polling the simulator's state
                await asyncio.sleep(0.02)
        r = await stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "more"}]))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "overloaded" and "max_tenant_concurrency" in r.json()["error"]["message"]
        stack.decode.cfg.stall_s = 0.0
        async with httpx.AsyncClient(
            base_url=stack.gateway.http_url, headers={"authorization": "Bearer key-globex"}, timeout=30
        ) as globex:
            g = await globex.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}], conv="g"))
        assert g.status_code == 200, g.text
    finally:
        stack.decode.engine.unstall.set()
        assert (await first).status_code == 200


@pytest.mark.parametrize("impl", ["httptools", "h11"])
async def test_header_deadline_on_both_uvicorn_protocols(impl: Literal["httptools", "h11"]) -> None:
    """The deadline on uvicorn's two HTTP implementations (the gateway uses httptools when it is installed):
    a silent connection, half a request line, and the second request of a keep-alive connection that stops
    halfway get 408; complete requests on the same connection are served."""

    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    timeouts: list[int] = []
    config = uvicorn.Config(
        Starlette(routes=[Route("/", ok)]),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        http=protocol_class(lambda: 0.5, lambda: timeouts.append(1), impl=impl),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 - uvicorn says when it listens
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]

        async def conn(payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            await writer.drain()
            return reader, writer

        silent, half = await conn(b""), await conn(b"GET / HTTP/1.1\r\nhost: x\r\n")
        reader, writer = await conn(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(10):
            first = await reader.readuntil(b"ok")
            assert first.startswith(b"HTTP/1.1 200 ")
            writer.write(b"GET / HTTP/1.1\r\nhost:")  # the next request stops halfway
            for r, _ in (silent, half, (reader, writer)):
                assert (await r.read()).startswith(b"HTTP/1.1 408 ")
        assert len(timeouts) == 3
        for _, w in (silent, half, (reader, writer)):
            w.close()
    finally:
        server.should_exit = True
        await task
