"""One tenant key cannot take the others (or the engines) down: per-principal stream/RPC limits on every kvbridge
gRPC server, idle KeepAlive streams closed, gRPC turns counted against the gateway's max_concurrency, and a
client's short gRPC deadline never counted as an engine failure (issue 30, ADR 0025).

Real servers over loopback gRPC with an API keys file; engine simulators behind the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge.errors import KvbridgeError, Reason, from_rpc_error
from kvbridge.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2
from kvbridge.sdk import ClientOptions, Heartbeater, LeaseClient
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.tools.engine_sim import SimConfig, SimServer

from .conftest import (
    ACME_KEY,
    BLOCK,
    ENGINE_KEY,
    GLOBEX_KEY,
    MODEL,
    SECRET_HEX,
    SERVICE_KEY,
    SecureStack,
    call,
    chain,
    md,
    write_keys,
)

IDLE_STREAMS = 1030  # more than the lease manager's whole default pool of 1,024 concurrent RPCs


async def _first_answer(call_: Any) -> lease_pb2.KeepAliveResponse | KvbridgeError:
    """One empty KeepAlive message on an open stream: its answer (the stream was admitted) or the typed error."""
    try:
        await call_.write(lease_pb2.KeepAliveRequest())
        resp = await asyncio.wait_for(call_.read(), 20)
    except asyncio.InvalidStateError:  # refused before the write: the status is read from the call
        return from_rpc_error(await _status(call_))
    except grpc.aio.AioRpcError as exc:
        return from_rpc_error(exc)
    assert isinstance(resp, lease_pb2.KeepAliveResponse), resp
    return resp


async def _status(call_: Any, within_s: float = 10.0) -> grpc.aio.AioRpcError:
    """The status that ends a stream (within ``within_s``: a test fails, never hangs)."""
    try:
        await asyncio.wait_for(call_.read(), within_s)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the stream did not end with an error")


async def _open_idle_streams(address: str, key: str, n: int, channels: int = 4) -> tuple[list[Any], list[Any]]:
    """``n`` KeepAlive streams on ``channels`` connections, each sent one empty message and then left idle.
    Returns (the admitted calls, the errors of the refused ones)."""
    chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    stubs = [lease_pb2_grpc.LeaseServiceStub(ch) for ch in chans]
    calls = [stubs[i % channels].KeepAlive(metadata=md(key)) for i in range(n)]
    results = await asyncio.gather(*(_first_answer(c) for c in calls))
    admitted = [c for c, r in zip(calls, results, strict=True) if isinstance(r, lease_pb2.KeepAliveResponse)]
    refused = [r for r in results if isinstance(r, KvbridgeError)]
    _OPEN_CHANNELS.extend(chans)
    return admitted, refused


_OPEN_CHANNELS: list[grpc.aio.Channel] = []


@pytest.fixture(autouse=True)
async def _close_channels() -> AsyncIterator[None]:
    yield
    while _OPEN_CHANNELS:
        await _OPEN_CHANNELS.pop().close()


def _per_tenant_refusals(errors: Sequence[KvbridgeError], cap: int) -> None:
    for err in errors:
        assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert err.reason == Reason.OVERLOADED.value, err
        assert err.metadata == {"limit": "per_tenant", "max": str(cap)}, err


async def _renew_node(lease: lease_pb2_grpc.LeaseServiceAsyncStub, lease_id: int) -> bool:
    """An engine's node-lease renewal, the way the connector sends it (one message on a short stream)."""
    call_ = lease.KeepAlive(
        iter([lease_pb2.KeepAliveRequest(lease_ids=[lease_id])]), metadata=md(ENGINE_KEY), timeout=5
    )
    statuses = [s async for resp in call_ for s in resp.statuses]
    return len(statuses) == 1 and statuses[0].alive


@pytest.mark.serial  # 1,030 streams at once: beside another worker's suite a stream was cancelled, not refused
async def test_a_thousand_idle_streams_from_one_tenant_starve_no_one(secure: SecureStack) -> None:
    """Issue 30 item 2: 1,030 idle KeepAlive streams on acme's key filled the lease manager's single pool of
    1,024 RPCs; engines' node-lease renewals got RESOURCE_EXHAUSTED. Now acme holds its 128 and no more."""
    node = await call(
        secure.lease.GrantLease,
        lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d7", ttl=Duration(seconds=60)),
        ENGINE_KEY,
    )
    globex_tokens = list(range(100, 100 + 4 * BLOCK))
    await secure.register("globex", "g-conv", globex_tokens)
    started = time.monotonic()
    admitted, refused = await _open_idle_streams(secure.lease_app.address, ACME_KEY, IDLE_STREAMS)
    assert len(admitted) == 128 and len(refused) == IDLE_STREAMS - 128, (len(admitted), len(refused))
    _per_tenant_refusals(refused, 128)
    opened_s = time.monotonic() - started

    # Engines renew their node leases; another tenant renews and looks up its own; the gateway keeps serving.
    for _ in range(3):
        assert await _renew_node(secure.lease, node.lease.lease_id)
    renew = secure.lease.KeepAlive(
        iter(
            [
                lease_pb2.KeepAliveRequest(
                    conversations=[lease_pb2.ConversationRef(model=MODEL, conversation_key="g-conv")]
                )
            ]
        ),
        metadata=md(GLOBEX_KEY),
        timeout=10,
    )
    assert [s.alive async for resp in renew for s in resp.statuses] == [True]
    hit = await call(
        secure.registry.LookupEntry,
        registry_pb2.LookupEntryRequest(
            model=MODEL, conversation_key="g-conv", block_hashes=chain(globex_tokens, "globex"), block_size=BLOCK
        ),
        GLOBEX_KEY,
    )
    assert hit.location.engine.engine_id == "d0" and hit.verified_tokens == len(globex_tokens)
    async with secure.http(GLOBEX_KEY) as client:
        assert (await client.get("/readyz")).status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "w101 w102"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    # acme itself is served again as soon as one of its streams ends.
    admitted[0].cancel()
    limiter = secure.lease_app.server.limiter
    assert limiter is not None
    async with asyncio.timeout(10):
        while limiter.by_tenant.get("acme") != 127:  # noqa: ASYNC110 - the server ends the stream in its own task
            await asyncio.sleep(0.02)
    more, none = await _open_idle_streams(secure.lease_app.address, ACME_KEY, 2, channels=1)
    assert len(more) == 1 and len(none) == 1
    print(f"\n{IDLE_STREAMS} idle tenant streams: 128 admitted, {len(refused)} refused in {opened_s:.1f}s")
    for c in (*admitted, *more):
        c.cancel()


@pytest.fixture
async def lease_server(tmp_path: Path) -> AsyncIterator[LeaseApp]:
    """A lease manager alone, with small limits: 16 RPCs, tenants 8 together and 8 each (the tenant share is the
    binding limit), KeepAlive streams idle for 0.5 s closed."""
    auth = Authenticator.from_file(write_keys(tmp_path / "keys.json"))
    store = MemoryStore()
    app = LeaseApp(
        store,
        LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5, keepalive_idle_s=0.5),
        ServerSettings(shutdown_grace_s=0.2, max_concurrent_rpcs=16, max_rpcs_per_tenant=8, max_public_rpcs=2),
        auth=auth,
    )
    await app.start()
    try:
        async with asyncio.timeout(10):
            while not app.is_leader:  # noqa: ASYNC110 - the election runs in the app's own task
                await asyncio.sleep(0.02)
        yield app
    finally:
        await app.stop(0.1)
        await store.close()


async def test_tenants_together_keep_to_their_share(lease_server: LeaseApp) -> None:
    admitted, refused = await _open_idle_streams(lease_server.address, ACME_KEY, 10, channels=1)
    assert len(admitted) == 8
    _per_tenant_refusals(refused, 8)
    # globex is refused too: tenants hold their whole share (8 of 16) ...
    others, globex_refused = await _open_idle_streams(lease_server.address, GLOBEX_KEY, 1, channels=1)
    assert others == [] and globex_refused[0].metadata == {"limit": "tenant_pool", "max": "8"}
    # ... which leaves the engine its own.
    async with grpc.aio.insecure_channel(lease_server.address) as ch:
        lease = lease_pb2_grpc.LeaseServiceStub(ch)
        node = await call(
            lease.GrantLease,
            lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d1", ttl=Duration(seconds=30)),
            ENGINE_KEY,
        )
        assert await _renew_node(lease, node.lease.lease_id)
    for c in admitted:
        c.cancel()


async def test_an_idle_keepalive_stream_is_closed_after_its_limit(lease_server: LeaseApp) -> None:
    async with grpc.aio.insecure_channel(lease_server.address) as ch:
        lease = lease_pb2_grpc.LeaseServiceStub(ch)
        idle = lease.KeepAlive(metadata=md(ACME_KEY))
        busy = lease.KeepAlive(metadata=md(ACME_KEY))
        assert isinstance(await _first_answer(idle), lease_pb2.KeepAliveResponse)
        started = time.monotonic()

        async def idle_end() -> tuple[grpc.aio.AioRpcError, float]:
            status = await _status(idle)
            return status, time.monotonic() - started

        ended = asyncio.create_task(idle_end())
        # The busy stream renews every 0.2 s (well inside the 0.5 s limit) and stays open meanwhile.
        for _ in range(6):
            await busy.write(lease_pb2.KeepAliveRequest())
            assert isinstance(await busy.read(), lease_pb2.KeepAliveResponse)
            await asyncio.sleep(0.2)
        status, closed_after = await ended
        err = from_rpc_error(status)
        assert err.code is grpc.StatusCode.UNAVAILABLE and err.reason == Reason.STREAM_IDLE.value, err
        assert err.metadata == {"idle_limit_s": "0.5"}
        assert 0.45 < closed_after < 1.5, closed_after
        print(f"\nidle KeepAlive stream (limit 0.5 s) closed after {closed_after:.2f} s; the busy one stayed open")
        await busy.done_writing()
        assert await busy.read() is grpc.aio.EOF
        # The closed stream gave its slot back: a tenant at its cap opens a new one.
        assert lease_server.server.limiter is not None
        assert lease_server.server.limiter.by_tenant.get("acme", 0) == 0


# --- the gateway's gRPC door -------------------------------------------------------------------------------


def _static(sim: SimServer, engine_id: str) -> StaticEngine:
    return StaticEngine(
        url=sim.url,
        model=MODEL,
        engine_id=engine_id,
        kv_host="127.0.0.1",
        kv_port=sim.cfg.port,
        block_size=BLOCK,
        register_in_registry=True,
    )


@dataclass
class GatewayStack:
    gateway: GatewayApp
    prefill: SimServer
    decode: SimServer

    def stub(self) -> gateway_pb2_grpc.GatewayServiceAsyncStub:
        channel = grpc.aio.insecure_channel(self.gateway.grpc_address)
        _OPEN_CHANNELS.append(channel)
        return gateway_pb2_grpc.GatewayServiceStub(channel)

    def http(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.gateway.http_url, headers={"authorization": f"Bearer {key}"}, timeout=30)


@contextlib.asynccontextmanager
async def gateway_stack(
    tmp_path: Path, *, decode: SimConfig, prefill: SimConfig, grpc_server: ServerSettings, **gateway: Any
) -> AsyncIterator[GatewayStack]:
    auth = Authenticator.from_file(write_keys(tmp_path / "keys.json"))
    store = MemoryStore()
    p, d = SimServer(prefill), SimServer(decode)
    async with contextlib.AsyncExitStack() as held:
        held.push_async_callback(store.close)
        for sim in (p, d):
            await held.enter_async_context(sim)
        settings = GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            control_api_key=SERVICE_KEY,
            hash_secret_hex=SECRET_HEX,
            default_block_size=BLOCK,
            reuse_threshold_tokens=BLOCK,
            prefill_engines=[_static(p, "p0")],
            decode_engines=[_static(d, "d0")],
            engines_from_registry=False,
            health_interval_s=0.5,
            **gateway,
        )
        services = await held.enter_async_context(
            ServiceStack(
                store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
                registry=RegistrySettings(port=0, lease_service_api_key=SERVICE_KEY),
                gateway=settings,
                server=ServerSettings(shutdown_grace_s=0.2),
                gateway_server=grpc_server,
                auth=auth,
                gateway_auth=auth,
                stop_grace_s=0.1,
            )
        )
        assert services.gateway is not None
        async with asyncio.timeout(10):
            while not services.gateway.core.ready():  # noqa: ASYNC110 - health checks run in the gateway
                await asyncio.sleep(0.05)
        yield GatewayStack(services.gateway, p, d)


def _chat(content: str = "w101 w102 w103", *, timeout: Duration | None = None) -> Any:
    req = gateway_pb2.CreateChatCompletionRequest(
        model=MODEL,
        messages=[gateway_pb2.ChatMessage(role="user", content=content)],
        sampling=gateway_pb2.SamplingParams(max_tokens=4),
    )
    if timeout is not None:
        req.timeout.CopyFrom(timeout)
    return req


async def _turn(stub: gateway_pb2_grpc.GatewayServiceAsyncStub, key: str, **kw: Any) -> str:
    """A whole gRPC turn: its text, or the typed error raised."""
    try:
        return "".join([m.delta_content async for m in stub.CreateChatCompletion(_chat(**kw), metadata=md(key))])
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None


async def test_gateway_grpc_per_tenant_cap_and_max_concurrency(tmp_path: Path) -> None:
    """The gRPC door: a tenant holds at most its cap of streams (RESOURCE_EXHAUSTED / per_tenant), and every
    gRPC turn takes a max_concurrency slot, as an HTTP turn does (issue 30 item 8)."""
    stalled = SimConfig(role="decode", model=MODEL, block_size=BLOCK, stall_s=30, stall_after_tokens=1)
    async with gateway_stack(
        tmp_path,
        decode=stalled,
        prefill=SimConfig(role="prefill", model=MODEL, block_size=BLOCK),
        grpc_server=ServerSettings(shutdown_grace_s=0.2, max_concurrent_rpcs=64, max_rpcs_per_tenant=2),
        max_concurrency=3,
    ) as stack:
        core = stack.gateway.core
        stub = stack.stub()
        # Two acme turns, each stalled after its first token: both hold a stream and a turn slot.
        held = [stub.CreateChatCompletion(_chat(), metadata=md(ACME_KEY)) for _ in range(2)]
        for h in held:
            first = await asyncio.wait_for(h.read(), 10)
            assert isinstance(first, gateway_pb2.CreateChatCompletionResponse)
        assert core.inflight == 2
        with pytest.raises(KvbridgeError) as info:
            await _turn(stub, ACME_KEY)
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "OVERLOADED"
        assert info.value.metadata == {"limit": "per_tenant", "max": "2"}
        # globex takes the third and last slot of max_concurrency=3 ...
        third = stub.CreateChatCompletion(_chat(), metadata=md(GLOBEX_KEY))
        assert isinstance(await asyncio.wait_for(third.read(), 10), gateway_pb2.CreateChatCompletionResponse)
        assert core.inflight == 3
        # ... so a fourth turn, gRPC or HTTP, is refused by max_concurrency, not by its tenant's cap.
        with pytest.raises(KvbridgeError) as info:
            await _turn(stub, GLOBEX_KEY)
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "OVERLOADED"
        assert info.value.metadata == {"limit": "max_concurrency"}  # the gateway's turn slots, shared with HTTP
        async with stack.http(GLOBEX_KEY) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 429, resp.text
            assert (await client.get("/readyz")).status_code == 200
        for h in (*held, third):
            h.cancel()
        async with asyncio.timeout(5):
            while core.inflight:  # noqa: ASYNC110 - the cancelled turns end in the gateway's tasks
                await asyncio.sleep(0.02)
        assert stack.gateway._grpc.limiter is not None and stack.gateway._grpc.limiter.by_tenant == {}


async def test_grpc_turns_take_the_tenant_turn_slots(tmp_path: Path) -> None:
    """max_tenant_concurrency bounds a tenant's gRPC turns too (the HTTP door's rule, counted per door)."""
    stalled = SimConfig(role="decode", model=MODEL, block_size=BLOCK, stall_s=30, stall_after_tokens=1)
    async with gateway_stack(
        tmp_path,
        decode=stalled,
        prefill=SimConfig(role="prefill", model=MODEL, block_size=BLOCK),
        grpc_server=ServerSettings(shutdown_grace_s=0.2),
        max_tenant_concurrency=1,
    ) as stack:
        stub = stack.stub()
        held = stub.CreateChatCompletion(_chat(), metadata=md(ACME_KEY))
        assert isinstance(await asyncio.wait_for(held.read(), 10), gateway_pb2.CreateChatCompletionResponse)
        with pytest.raises(KvbridgeError) as info:
            await _turn(stub, ACME_KEY)
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "OVERLOADED"
        assert info.value.metadata == {"limit": "max_tenant_concurrency"}
        other = stub.CreateChatCompletion(_chat(), metadata=md(GLOBEX_KEY))
        assert isinstance(await asyncio.wait_for(other.read(), 10), gateway_pb2.CreateChatCompletionResponse)
        held.cancel()
        other.cancel()


async def test_a_client_deadline_is_not_an_engine_failure(tmp_path: Path) -> None:
    """A 1 ms gRPC timeout used to eject P for seconds (up to "no traffic for 80 s" when repeated); a negative one
    was taken as given. Now: negative is INVALID_ARGUMENT, a short one expires as the client's DEADLINE_EXCEEDED
    and the engines stay in rotation."""
    async with gateway_stack(
        tmp_path,
        decode=SimConfig(role="decode", model=MODEL, block_size=BLOCK, prefill_us_per_token=20_000.0),
        prefill=SimConfig(role="prefill", model=MODEL, block_size=BLOCK, prefill_us_per_token=20_000.0),
        grpc_server=ServerSettings(shutdown_grace_s=0.2),
    ) as stack:
        stub = stack.stub()
        with pytest.raises(KvbridgeError) as info:
            await _turn(stub, ACME_KEY, timeout=Duration(seconds=-1))
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and info.value.reason == "INVALID_FIELD"
        assert info.value.metadata.get("field") == "timeout"
        with pytest.raises(KvbridgeError) as info:
            await _turn(stub, ACME_KEY, timeout=Duration(nanos=-1_000_000))
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT

        for _ in range(5):
            with pytest.raises(KvbridgeError) as info:
                await _turn(stub, ACME_KEY, timeout=Duration(nanos=1_000_000))
            assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, info.value
        for engine in stack.gateway.core.pool.all():
            assert engine.healthy and engine.consecutive_timeouts == 0, engine
            assert not engine.ejected(time.monotonic()), engine
        assert await _turn(stub, ACME_KEY)  # no timeout: the server's deadlines, served at once
        assert stack.gateway.core.inflight == 0
        print("\n5 turns with a 1 ms timeout: DEADLINE_EXCEEDED, engines ejected: 0, consecutive timeouts: 0")


async def test_connections_past_their_age_are_closed_and_clients_reconnect(tmp_path: Path) -> None:
    """max_connection_age reaches grpc: a stream on an old connection ends after the grace, and the next call on
    the same channel is served on a new connection."""
    auth = Authenticator.from_file(write_keys(tmp_path / "keys.json"))
    store = MemoryStore()
    app = LeaseApp(
        store,
        LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
        ServerSettings(shutdown_grace_s=0.1, max_connection_age_s=0.5, max_connection_age_grace_s=0.5),
        auth=auth,
    )
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.address) as ch:
            lease = lease_pb2_grpc.LeaseServiceStub(ch)
            async with asyncio.timeout(10):
                while not app.is_leader:  # noqa: ASYNC110 - the election runs in the app's own task
                    await asyncio.sleep(0.02)
            stream = lease.KeepAlive(metadata=md(ACME_KEY))
            started = time.monotonic()
            ended: grpc.aio.AioRpcError | None = None
            while time.monotonic() - started < 10:
                try:
                    await stream.write(lease_pb2.KeepAliveRequest())
                    await asyncio.wait_for(stream.read(), 5)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    ended = await _status(stream)
                    break
                await asyncio.sleep(0.1)
            lived = time.monotonic() - started
            assert ended is not None and ended.code() is grpc.StatusCode.UNAVAILABLE, ended
            assert 0.4 < lived < 3.0, lived  # age 0.5 s (+-10 % jitter) plus 0.5 s grace
            renewed = lease.KeepAlive(iter([lease_pb2.KeepAliveRequest()]), metadata=md(ACME_KEY), timeout=10)
            assert [r async for r in renewed]  # the same channel, a new connection
            print(f"\nstream on a connection with max age 0.5 s + 0.5 s grace ended after {lived:.2f} s")
    finally:
        await app.stop(0.1)
        await store.close()


async def test_the_sdk_reopens_a_stream_closed_while_idle_without_a_warning(
    lease_server: LeaseApp, caplog: pytest.LogCaptureFixture
) -> None:
    """A Heartbeater with nothing to renew has its stream closed at the idle limit (0.5 s here); the SDK sees the
    close when it next has something to send, reopens as after the normal end it is (no warning), and renews."""
    caplog.set_level(logging.DEBUG, logger="kvbridge.sdk.lease")
    async with LeaseClient(lease_server.address, ClientOptions(api_key=ENGINE_KEY, timeout_s=5)) as client:
        lost: list[lease_pb2.LeaseStatus] = []
        heartbeater = Heartbeater(client, interval_s=0.2, on_lost=lost.append)
        heartbeater.start()
        try:
            await asyncio.sleep(1.2)  # past the idle limit with nothing to renew: the server closed the stream
            granted = await client.grant(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d-idle", ttl_s=5)
            heartbeater.add_lease(granted.lease.lease_id)
            heartbeater.renew_now()
            rounds = heartbeater.rounds
            async with asyncio.timeout(10):
                while heartbeater.streams_opened < 2 or heartbeater.rounds < rounds + 3:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            await heartbeater.stop()
        assert lost == []  # the lease was renewed on the reopened stream
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvbridge.sdk.lease"]
    assert warnings == [], [r.getMessage() for r in warnings]
    assert any("closed while idle" in r.getMessage() for r in caplog.records)
