"""Engine pool health: /health decides, load info is best effort, a down pool is re-probed on demand."""

from __future__ import annotations

import httpx
import pytest
from kvbridge.errors import Unavailable
from kvbridge_services.gateway.engines import DECODE, EnginePool


def _pool(handler: httpx.MockTransport) -> EnginePool:
    return EnginePool(httpx.AsyncClient(transport=handler), health_timeout_s=1.0, kv_usage_weight=4.0)


async def test_slow_metrics_do_not_mark_an_engine_down() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            raise httpx.ReadTimeout("metrics too slow", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        return httpx.Response(200)

    pool = _pool(httpx.MockTransport(handle))
    engine = pool.add_static("http://d:1", DECODE)
    await pool.check(engine)
    assert engine.healthy
    assert pool.choose("tiny", DECODE) is engine


async def test_a_pool_marked_down_is_probed_before_refusing() -> None:
    up = {"ok": True}

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if up["ok"] else 503, json={"data": [{"id": "tiny"}]})

    pool = _pool(httpx.MockTransport(handle))
    engine = pool.add_static("http://d:1", DECODE, model="tiny")
    pool.mark_failed(engine, "transport error")  # e.g. a stall missed the periodic check
    assert (await pool.choose_live("tiny", DECODE)) is engine
    assert engine.healthy

    up["ok"] = False
    pool.mark_failed(engine, "down for real")
    engine.last_check = 0.0
    with pytest.raises(Unavailable):
        await pool.choose_live("tiny", DECODE)


async def test_upstream_timeouts_are_told_apart_from_other_failures() -> None:
    from kvbridge_services.gateway.upstream import UpstreamError, post_json

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("engine too slow", request=request)

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    for handler, timed_out in ((slow, True), (broken, False)):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            with pytest.raises(UpstreamError) as err:
                await post_json(http, "http://p:1/v1/completions", {}, timeout_s=1.0)
        assert err.value.transport and err.value.timed_out is timed_out
