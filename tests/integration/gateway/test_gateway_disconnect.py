"""A client that goes away mid-turn: the gateway cancels its upstream request, so no engine keeps working
(or keeps KV) for an answer nobody will read."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx
import pytest

from tests.fixtures.gateway_stack import LONG, chat

from .conftest import Stack


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - polling other components' state
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_cancels_the_decode_upstream(stack: Stack, stream: bool) -> None:
    stack.decode.cfg.stall_s = 30.0  # D stalls after its first token, as a long generation would
    stack.decode.cfg.stall_after_tokens = 1
    d = stack.decode.engine.stats
    client = httpx.AsyncClient(
        base_url=stack.gateway.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30
    )

    async def one_turn() -> None:
        body = chat([{"role": "user", "content": LONG}], conv="gone-1", stream=stream)
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                pass

    request = asyncio.create_task(one_turn())
    try:
        await _until(lambda: d.stalled >= 1 and d.running == 1)
        assert stack.gateway.core.inflight == 1
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await client.aclose()  # the client's connection is gone
        await _until(lambda: d.running == 0)
        if not stream:
            assert d.cancelled == 1  # D saw its caller (the gateway) leave, as vLLM's with_cancellation does
        await _until(lambda: stack.gateway.core.inflight == 0)
    finally:
        stack.decode.engine.unstall.set()
        await client.aclose()
