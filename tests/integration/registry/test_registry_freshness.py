"""Fresh answers only: a registry whose watch-fed index stops hearing from the store answers INDEX_STALE (never
a possibly-stale hit) within its bound, reports NOT_SERVING, and recovers. Real gRPC; a stopped feeder on
MemoryStore, and a frozen (SIGSTOPped) real etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.control import KeyedLookup
from tests.fixtures.etcd import EtcdServer

from .conftest import Env, etcd_store, start_env, stop_env

V = registry_pb2.LookupVerdict
HISTORY = list(range(3000, 3000 + 40))
MAX_LAG_S = 0.6
SERVICE = "kvbridge.registry.v1.RegistryService"


async def health(env: Env) -> int:
    stub = health_pb2_grpc.HealthStub(env.channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
    return int(resp.status)


async def until_verdict(env: Env, verdict: int, timeout_s: float = 15.0) -> float:
    """Seconds until a lookup answers ``verdict``; every answer on the way is checked to be a hit or it."""
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            got = await env.lookup(HISTORY)
            if got.verdict == verdict:
                return time.monotonic() - start
            assert got.verdict == V.LOOKUP_VERDICT_HIT, got
            await asyncio.sleep(0.02)


def lag_gauge(env: Env) -> float:
    text = generate_latest(env.app.telemetry.registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("kvbridge_registry_index_lag_seconds "))
    return float(line.split()[1])


@pytest.fixture
async def memory_env() -> AsyncIterator[Env]:
    store = MemoryStore()
    env = await start_env(store, index_max_lag_s=MAX_LAG_S)
    try:
        yield env
    finally:
        await stop_env(env)
        await store.close()


async def test_a_stopped_feeder_turns_hits_into_index_stale_and_not_serving(memory_env: Env) -> None:
    env = memory_env
    await env.engine()
    await env.register(HISTORY)
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT
    assert await health(env) == health_pb2.HealthCheckResponse.SERVING
    assert 0 <= lag_gauge(env) <= MAX_LAG_S

    await env.app.feeder.stop()  # the index no longer hears from the store
    await until_verdict(env, V.LOOKUP_VERDICT_INDEX_STALE)
    got = await env.lookup(HISTORY)
    assert got.verdict == V.LOOKUP_VERDICT_INDEX_STALE and not got.HasField("location")
    async with asyncio.timeout(5):
        while await health(env) != health_pb2.HealthCheckResponse.NOT_SERVING:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.05)
    assert lag_gauge(env) > MAX_LAG_S

    await env.app.feeder.start()  # recovers: fresh list, hits again, SERVING
    assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT
    async with asyncio.timeout(5):
        while await health(env) != health_pb2.HealthCheckResponse.SERVING:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.05)


@pytest.mark.etcd
@pytest.mark.serial  # a time bound (scripts/test)
async def test_a_frozen_etcd_stops_hits_within_the_bound_and_recovers(etcd_server: EtcdServer) -> None:
    store = etcd_store([etcd_server.endpoint])
    env = await start_env(store, index_max_lag_s=MAX_LAG_S)
    pid = etcd_server.pid
    assert pid is not None
    frozen = False
    try:
        await env.engine()
        await env.register(HISTORY)
        assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT
        await asyncio.sleep(3 * MAX_LAG_S)  # idle: progress notifications keep the index fresh
        assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_HIT

        os.kill(pid, signal.SIGSTOP)
        frozen = True
        took = await until_verdict(env, V.LOOKUP_VERDICT_INDEX_STALE)
        print(f"frozen etcd: INDEX_STALE after {took:.2f}s (bound {MAX_LAG_S}s)")
        async with asyncio.timeout(5):
            while await health(env) != health_pb2.HealthCheckResponse.NOT_SERVING:  # noqa: ASYNC110 - polls state owned by another task
                await asyncio.sleep(0.05)
        await asyncio.sleep(6)  # past restart_after_s (5 s): the supervisor restarts the silent watch
        assert (await env.lookup(HISTORY)).verdict == V.LOOKUP_VERDICT_INDEX_STALE

        os.kill(pid, signal.SIGCONT)
        frozen = False
        await until_verdict_hit(env)
        async with asyncio.timeout(10):
            while await health(env) != health_pb2.HealthCheckResponse.SERVING:  # noqa: ASYNC110 - polls state owned by another task
                await asyncio.sleep(0.05)
        assert env.app.feeder.restarts >= 1
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        await stop_env(env)
        await store.close()


async def until_verdict_hit(env: Env, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while (await env.lookup(HISTORY)).verdict != V.LOOKUP_VERDICT_HIT:  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(0.05)


@pytest.mark.etcd
async def test_the_gateway_mirror_stops_answering_when_the_registry_store_freezes(etcd_server: EtcdServer) -> None:
    """The gateway's entry mirror follows WatchEntries of a registry on a real etcd; the registry sends progress
    only when etcd answers, so a frozen etcd stops the mirror's hits within its stale_after_s, and they resume."""
    from kvbridge_services.gateway.control import ControlPlane
    from kvbridge_services.gateway.mirror import EntryMirror, follow_registry

    from .conftest import BLOCK, MODEL, chain

    store = etcd_store([etcd_server.endpoint])
    env = await start_env(store, index_max_lag_s=MAX_LAG_S)
    control = ControlPlane(env.app.address, "", api_key=None, timeout_s=2)
    stale_after_s = 0.6
    mirror = EntryMirror(max_entries=100, stale_after_s=stale_after_s)
    follower = asyncio.create_task(
        follow_registry(control, mirror, progress_interval_s=stale_after_s / 3, stream_lifetime_s=60)
    )
    pid = etcd_server.pid
    assert pid is not None
    frozen = False
    try:
        engine = await env.engine()
        await env.register(HISTORY)

        def mirror_hit() -> bool:
            got = mirror.lookup(
                KeyedLookup(
                    tenant="acme",
                    model=MODEL,
                    conversation_key="c1",
                    block_hashes=chain(HISTORY),
                    block_size=BLOCK,
                    min_tokens=0,
                ),
                engine_record={"d0": engine}.get,
            )
            return got is not None and got.verdict == V.LOOKUP_VERDICT_HIT

        async with asyncio.timeout(10):
            while not mirror_hit():  # noqa: ASYNC110 - polls state owned by another task
                await asyncio.sleep(0.02)
        await asyncio.sleep(3 * stale_after_s)  # idle: the registry's progress messages keep it in sync
        assert mirror_hit() and mirror.in_sync()

        os.kill(pid, signal.SIGSTOP)
        frozen = True
        start = time.monotonic()
        async with asyncio.timeout(15):
            while mirror_hit():  # noqa: ASYNC110 - polls state owned by another task
                await asyncio.sleep(0.02)
        print(
            f"frozen etcd: mirror stopped answering after {time.monotonic() - start:.2f}s "
            f"(stale_after_s {stale_after_s}s)"
        )
        assert not mirror.in_sync() and (mirror.lag_s() or 0) > stale_after_s
        # And the registry it falls back to answers INDEX_STALE within its own bound (hits until then).
        await until_verdict(env, V.LOOKUP_VERDICT_INDEX_STALE)

        os.kill(pid, signal.SIGCONT)
        frozen = False
        async with asyncio.timeout(20):
            while not mirror_hit():  # noqa: ASYNC110 - polls state owned by another task
                await asyncio.sleep(0.05)
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await control.close()
        await stop_env(env)
        await store.close()
