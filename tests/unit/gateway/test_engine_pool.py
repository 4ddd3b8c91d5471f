"""Engine pool health: /health decides, load info is best effort, a down pool is re-probed on demand.

The engines are small aiohttp servers on loopback: the gateway's real HTTP client talks to them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kvbridge.errors import Unavailable
from kvbridge_services.gateway.engines import DECODE, EnginePool
from kvbridge_services.gateway.upstream import EngineHttp, UpstreamError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def _engine(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _pool(handler: Handler) -> AsyncIterator[tuple[EnginePool, str]]:
    http = EngineHttp(connect_timeout_s=1.0)
    async with _engine(handler) as url:
        try:
            yield EnginePool(http, health_timeout_s=0.5, kv_usage_weight=4.0), url
        finally:
            await http.aclose()


async def test_slow_metrics_do_not_mark_an_engine_down() -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            await asyncio.sleep(1.5)  # past the health deadline
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "tiny"}]})
        return web.Response(status=200)

    async with _pool(handle) as (pool, url):
        engine = pool.add_static(url, DECODE)
        await pool.check(engine)
        assert engine.healthy
        assert pool.choose("tiny", DECODE) is engine


async def test_a_pool_marked_down_is_probed_before_refusing() -> None:
    up = {"ok": True}

    async def handle(request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": [{"id": "tiny"}]}, status=200 if up["ok"] else 503)

    async with _pool(handle) as (pool, url):
        engine = pool.add_static(url, DECODE, model="tiny")
        pool.mark_failed(engine, "transport error")  # e.g. a stall missed the periodic check
        assert (await pool.choose_live("tiny", DECODE)) is engine
        assert engine.healthy

        up["ok"] = False
        pool.mark_failed(engine, "down for real")
        engine.last_check = 0.0
        with pytest.raises(Unavailable):
            await pool.choose_live("tiny", DECODE)


async def test_upstream_timeouts_are_told_apart_from_other_failures() -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1.5)
        return web.Response()

    http = EngineHttp(connect_timeout_s=1.0)
    try:
        async with _engine(slow) as url:
            with pytest.raises(UpstreamError) as err:
                await http.post_json(f"{url}/v1/completions", {}, timeout_s=0.3)
            assert err.value.transport and err.value.timed_out
        # The server is gone now: connection refused is a transport failure, not a timeout.
        with pytest.raises(UpstreamError) as err:
            await http.post_json(f"{url}/v1/completions", {}, timeout_s=1.0)
        assert err.value.transport and not err.value.timed_out
    finally:
        await http.aclose()


async def test_engine_4xx_is_the_clients_fault_and_5xx_is_an_upstream_failure() -> None:
    from kvbridge_services.gateway.upstream import ClientError

    async def handle(request: web.Request) -> web.StreamResponse:
        status = 400 if request.path == "/bad" else 500
        return web.json_response({"error": {"message": request.path}}, status=status)

    http = EngineHttp(connect_timeout_s=1.0)
    try:
        async with _engine(handle) as url:
            with pytest.raises(ClientError) as client_err:
                await http.post_json(f"{url}/bad", {}, timeout_s=1.0)
            assert client_err.value.status == 400 and client_err.value.body["error"]["message"] == "/bad"
            with pytest.raises(UpstreamError) as up_err:
                await http.open_stream(f"{url}/broken", {}, connect_timeout_s=1.0, read_timeout_s=1.0)
            assert up_err.value.status == 500 and not up_err.value.transport
    finally:
        await http.aclose()


def test_an_engine_that_timed_out_gets_no_new_traffic_for_a_while() -> None:
    from kvbridge_services.gateway import engines
    from kvbridge_services.gateway.engines import PREFILL

    pool = EnginePool(EngineHttp(connect_timeout_s=1.0), health_timeout_s=0.5, kv_usage_weight=4.0)
    hung = pool.add_static("http://p0:1", PREFILL, model="tiny")
    other = pool.add_static("http://p1:1", PREFILL, model="tiny")
    for e in (hung, other):
        e.healthy = True
    other.outstanding = 5  # busier: chosen only because the idle one is ejected
    assert pool.choose("tiny", PREFILL) is hung

    pool.timed_out(hung)
    assert pool.choose("tiny", PREFILL) is other
    first = hung.ejected_until
    pool.timed_out(hung)  # again in a row: ejected for longer
    assert hung.ejected_until - first >= engines.EJECT_BASE_S - 0.1

    pool.timed_out(other)  # every engine ejected: send to the one back soonest rather than fail
    assert pool.choose("tiny", PREFILL) is other

    hung.ejected_until = other.ejected_until = 0.0  # the ejections ran out
    pool.answered(hung)
    assert hung.consecutive_timeouts == 0 and pool.choose("tiny", PREFILL) is hung


async def test_only_a_refused_connection_puts_a_registered_stock_engine_on_a_new_incarnation() -> None:
    """A restarting vLLM refuses connections (45 s or more): its old blocks are gone, so the gateway must register
    it again before anyone pulls. A timeout is a live (slow) process: its entries stay usable."""
    slow = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        if slow.is_set():
            await asyncio.sleep(1.0)  # past the health deadline
        return web.Response(status=200)

    async with _pool(handle) as (pool, url):
        engine = pool.add_static(url, DECODE)
        engine.gateway_registered = True
        await pool.check(engine)
        assert engine.healthy and engine.offers_blocks
        slow.set()
        await pool.check(engine)  # timed out: unhealthy for now, but the same process
        assert not engine.healthy and not engine.needs_new_incarnation
        slow.clear()
        await pool.check(engine)
        assert engine.offers_blocks
    await pool.check(engine)  # the engine's port is closed now: connection refused
    assert not engine.healthy and engine.needs_new_incarnation
    engine.healthy = True  # even once healthy again, no pulls until the gateway registered it anew
    assert not engine.offers_blocks
