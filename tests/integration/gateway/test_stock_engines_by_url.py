"""Stock engines given by URL alone (ADR 0027): the gateway learns model, block size and NIXL identity from the
engines themselves, registers them (compatibility mode) and reuses from the second turn; an engine that does not
state what the registration needs fails the start with one line naming the fields."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.gateway.metrics import engine_label
from kvbridge_services.gateway.staticengines import StaticEngineError
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.fixtures.gateway_stack import KEYS, LONG, MODEL, SECRET_HEX
from tests.tools.engine_sim import SimConfig, SimServer

BLOCK = 32  # not the gateway's default_block_size (16): only the engines say what it is


@contextlib.asynccontextmanager
async def by_url(p: SimServer, d: SimServer, **gateway: Any) -> AsyncIterator[tuple[ServiceStack, httpx.AsyncClient]]:
    """Registry + lease manager + a gateway given the two engines as plain URLs, nothing else about them."""
    store = MemoryStore()
    settings = GatewaySettings.model_validate(
        {
            "host": "127.0.0.1",
            "http_port": 0,
            "grpc_port": 0,
            "hash_secret_hex": SECRET_HEX,
            "engines_from_registry": False,
            "health_interval_s": 0.3,
            "prefill_engines": p.url,
            "decode_engines": d.url,
            **gateway,
        }
    )
    async with contextlib.AsyncExitStack() as held:
        held.push_async_callback(store.close)
        services = await held.enter_async_context(
            ServiceStack(
                store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
                registry=RegistrySettings(port=0),
                gateway=settings,
                gateway_auth=Authenticator(KEYS),
                stop_grace_s=0.1,
            )
        )
        assert services.gateway is not None
        client = await held.enter_async_context(
            httpx.AsyncClient(
                base_url=services.gateway.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30
            )
        )
        yield services, client


@contextlib.asynccontextmanager
async def engines(**decode: Any) -> AsyncIterator[tuple[SimServer, SimServer]]:
    """A stock P and D (no engine id given: each draws one, as vLLM does), ``decode``: D's SimConfig changes."""
    async with (
        SimServer(SimConfig(role="prefill", model=MODEL, block_size=BLOCK)) as p,
        SimServer(SimConfig(role="decode", model=MODEL, block_size=BLOCK, **decode)) as d,
    ):
        yield p, d


async def reference(d: SimServer, messages: list[dict[str, str]]) -> str:
    async with httpx.AsyncClient() as c:
        r = await c.post(d.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
    return str(r.json()["choices"][0]["message"]["content"])


async def turn(
    gw: GatewayApp, client: httpx.AsyncClient, messages: list[dict[str, str]], conv: str | None
) -> tuple[str, str]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8}
    if conv:
        body["conversation_id"] = conv
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    await gw.core.router.drain()
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


@pytest.mark.parametrize("conv", ["c1", None], ids=["keyed", "keyless"])
async def test_engines_given_by_url_alone_reuse_from_the_second_turn(conv: str | None) -> None:
    async with engines() as (p, d), by_url(p, d) as (services, client):
        gw = services.gateway
        assert gw is not None
        records = {e.engine_id: e for e in await gw.core.control.list_engines()}
        # Registered with what each engine stated: its own id, block size, NIXL side channel, model.
        assert set(records) == {p.engine.engine_id, d.engine.engine_id}
        for sim in (p, d):
            rec = records[sim.engine.engine_id]
            assert (rec.block_size, rec.kv_host, rec.kv_port, rec.model, rec.http_url) == (
                BLOCK,
                "127.0.0.1",
                sim.cfg.port,
                MODEL,
                sim.url,
            )
        messages = [{"role": "user", "content": LONG}]
        answer, verdict = await turn(gw, client, messages, conv)
        assert verdict.startswith("miss")
        assert answer == await reference(d, messages)
        for _ in range(2):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
            answer, verdict = await turn(gw, client, messages, conv)
            assert verdict.startswith("hit;"), verdict
            assert answer == await reference(d, messages)  # reuse answers exactly what no reuse answers
        pulled = (await httpx.AsyncClient().get(p.url + "/sim/stats")).json()["remote_pulled_tokens"]
        assert pulled > 0
        lines = [r.line() for r in gw.core.routes()]
        assert any(
            line.startswith(f"decode {d.url}: model {MODEL}, compatibility mode, registered by") for line in lines
        )


@pytest.mark.parametrize(
    ("decode", "named"),
    [
        ({"cache_config_info": False}, "block_size not stated by the engine"),
        ({"kv_connector": False}, "engine_id, kv_host, kv_port not stated by the engine"),
    ],
    ids=["no-block-size", "no-kv-connector"],
)
async def test_an_engine_that_does_not_state_what_registration_needs_fails_the_start(
    decode: dict[str, Any], named: str
) -> None:
    async with engines(**decode) as (p, d):
        with pytest.raises(StaticEngineError) as failed:
            async with by_url(p, d):
                pass
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"engine {d.url} (decode) cannot be registered for reuse: {named}")
    assert "KVBRIDGE_GATEWAY_DECODE_ENGINES" in message and '"register_in_registry": false' in message


async def test_registration_opted_out_routes_without_reuse_and_without_a_warning_per_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with engines(cache_config_info=False) as (p, d), by_url(p, d, register_static_engines=False) as (s, client):
        gw = s.gateway
        assert gw is not None
        assert await gw.core.control.list_engines() == []
        messages = [{"role": "user", "content": LONG}]
        answer, verdict = await turn(gw, client, messages, "c1")
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        caplog.clear()
        answer, verdict = await turn(gw, client, messages, "c1")
        assert verdict.startswith("miss") and answer == await reference(d, messages)
        assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
        routes = {r.role: r.line() for r in gw.core.routes()}
        assert routes["prefill"].endswith("not registered: plain routing, no reuse (register_in_registry false)")


async def registered_gauge(client: httpx.AsyncClient, sim: SimServer) -> str:
    text = (await client.get("/metrics")).text
    found = [line for line in text.splitlines() if line.startswith("kvbridge_gateway_static_engine_registered{")]
    label = engine_label("", sim.url)  # given by URL alone: named by a digest of it, never the URL
    return next(line.rsplit(" ", 1)[1] for line in found if f'engine="{label}"' in line)


async def test_an_engine_that_answers_only_after_the_start_is_registered_once_it_does() -> None:
    """vLLM takes minutes to start: the gateway starts without it and registers it once it answers."""
    p = SimServer(SimConfig(role="prefill", model=MODEL, block_size=BLOCK))
    d = SimServer(SimConfig(role="decode", model=MODEL, block_size=BLOCK))  # bound, not listening: refused
    async with p, by_url(p, d) as (services, client):
        gw = services.gateway
        assert gw is not None
        assert [e.engine_id for e in await gw.core.control.list_engines()] == [p.engine.engine_id]
        routes = {r.role: r.line() for r in gw.core.routes()}
        assert routes["decode"].endswith("not registered yet (registered once it answers) (not healthy yet)")
        assert await registered_gauge(client, d) == "0.0"
        async with d:
            for _ in range(100):
                if d.engine.engine_id in {e.engine_id for e in await gw.core.control.list_engines()}:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("D was never registered")
            assert await registered_gauge(client, d) == "1.0"
            while not gw.core.ready():  # noqa: ASYNC110 - the health loop marks it healthy
                await asyncio.sleep(0.05)
            messages = [{"role": "user", "content": LONG}]
            answer, _ = await turn(gw, client, messages, "c1")
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
            answer, verdict = await turn(gw, client, messages, "c1")
            assert verdict.startswith("hit;"), verdict
            assert answer == await reference(d, messages)


async def test_a_restarted_engine_that_states_a_new_id_is_registered_again_under_it() -> None:
    """A stock vLLM draws a new engine id at each start: its old entries are never offered, the new id registers."""
    p = SimServer(SimConfig(role="prefill", model=MODEL, block_size=BLOCK))
    d = SimServer(SimConfig(role="decode", model=MODEL, block_size=BLOCK))
    await d.__aenter__()
    async with p, by_url(p, d) as (services, client):
        gw = services.gateway
        assert gw is not None
        messages = [{"role": "user", "content": LONG}]
        try:
            old_id = d.engine.engine_id
            answer, _ = await turn(gw, client, messages, "c1")
        finally:
            await d.__aexit__(None, None, None)
        for _ in range(100):  # a health check finds the connection refused
            state = gw.core.pool.find(old_id)
            if state is not None and state.needs_new_incarnation:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the stopped engine was never seen gone")
        again = SimServer(SimConfig(role="decode", model=MODEL, block_size=BLOCK, port=d.cfg.port))
        async with again:
            assert again.engine.engine_id != old_id
            for _ in range(100):
                ids = {e.engine_id for e in await gw.core.control.list_engines()}
                if again.engine.engine_id in ids:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the restarted engine was never registered")
            assert old_id not in ids
            while not gw.core.ready():  # noqa: ASYNC110 - the health loop marks it healthy
                await asyncio.sleep(0.05)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
            answer, verdict = await turn(gw, client, messages, "c1")
            assert not verdict.startswith("hit"), verdict  # the old process's blocks are gone
            assert answer == await reference(again, messages)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
            answer, verdict = await turn(gw, client, messages, "c1")
            assert verdict.startswith("hit;"), verdict
            assert answer == await reference(again, messages)
