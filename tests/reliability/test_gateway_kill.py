"""kill -9 of the gateway process mid-stream (registry + lease manager processes on etcd, simulators as P/D).

- the client's stream ends with an error, within a bound: no hang, and no "[DONE]" after a truncated answer;
- once the entry-lease TTL has passed, every registry entry names a live lease (nothing points at blocks
  nobody leases), and the conversation's entry, no longer renewed by anyone, is gone;
- a gateway restarted on the same ports answers the next turn of the same conversation correctly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from tests.fixtures.common import free_port
from tests.fixtures.etcd import EtcdServer
from tests.tools.engine_sim import SimConfig, SimServer

from .conftest import BLOCK, MODEL, SECRET_HEX
from .procs import ServiceProcess, lease_process, registry_process, service_env
from .simstack import LONG

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
ENTRY_TTL_S = 4.0
TOKEN_S = 0.2  # D's time per output token: a 40-token answer streams for ~8 s


@dataclass
class GatewayRig:
    gateway: ServiceProcess
    http_url: str
    prefill: SimServer
    decode: SimServer
    entries: registry_pb2_grpc.RegistryServiceAsyncStub
    leases: lease_pb2_grpc.LeaseServiceAsyncStub


def _engine(sim: SimServer) -> dict[str, object]:
    return {
        "url": sim.url,
        "model": MODEL,
        "engine_id": sim.cfg.engine_id,
        "kv_host": "127.0.0.1",
        "kv_port": sim.cfg.port,
        "block_size": BLOCK,
        "register_in_registry": True,
    }


@pytest.fixture
async def rig(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[GatewayRig]:
    lease = lease_process(etcd_server.endpoint, tmp_path)
    registry = registry_process(etcd_server.endpoint, lease.target, tmp_path)
    p = SimServer(SimConfig(role="prefill", engine_id="p0", model=MODEL, block_size=BLOCK))
    d = SimServer(
        SimConfig(role="decode", engine_id="d0", model=MODEL, block_size=BLOCK, decode_us_per_token=TOKEN_S * 1e6)
    )
    http_port = free_port()
    env = service_env(
        etcd_server.endpoint,
        KVBRIDGE_GATEWAY_HTTP_PORT=str(http_port),
        KVBRIDGE_GATEWAY_REGISTRY_ADDRESS=registry.target,
        KVBRIDGE_GATEWAY_LEASE_ADDRESS=lease.target,
        KVBRIDGE_GATEWAY_HASH_SECRET_HEX=SECRET_HEX,
        KVBRIDGE_GATEWAY_DEFAULT_BLOCK_SIZE=str(BLOCK),
        KVBRIDGE_GATEWAY_REUSE_THRESHOLD_TOKENS=str(BLOCK),
        KVBRIDGE_GATEWAY_ENGINES_FROM_REGISTRY="false",
        KVBRIDGE_GATEWAY_ENTRY_LEASE_TTL_S=str(ENTRY_TTL_S),
        KVBRIDGE_GATEWAY_PREFILL_ENGINES=json.dumps([_engine(p)]),
        KVBRIDGE_GATEWAY_DECODE_ENGINES=json.dumps([_engine(d)]),
    )
    gateway = ServiceProcess("kvbridge_services.gateway", env, tmp_path, port_var="KVBRIDGE_GATEWAY_GRPC_PORT")
    await p.__aenter__()
    await d.__aenter__()
    try:
        lease.start()
        registry.start()
        gateway.start()
        async with grpc.aio.insecure_channel(registry.target) as rch, grpc.aio.insecure_channel(lease.target) as lch:
            yield GatewayRig(
                gateway,
                f"http://127.0.0.1:{http_port}",
                p,
                d,
                registry_pb2_grpc.RegistryServiceStub(rch),
                lease_pb2_grpc.LeaseServiceStub(lch),
            )
    finally:
        gateway.stop()
        registry.stop()
        lease.stop()
        await d.__aexit__(None, None, None)
        await p.__aexit__(None, None, None)


async def _turn(http: httpx.AsyncClient, msgs: list[dict[str, str]], conv: str) -> tuple[str, str]:
    async with asyncio.timeout(60):  # the gateway may still be registering its engines after a start
        while True:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "max_tokens": 6, "conversation_id": conv},
            )
            if r.status_code != 503:
                break
            await asyncio.sleep(0.3)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


async def _dangling(rig: GatewayRig) -> tuple[int, list[str]]:
    """(entries, conversation keys of entries whose lease is gone)."""
    resp = await rig.entries.ListEntries(registry_pb2.ListEntriesRequest(tenant="default", page_size=1000), timeout=10)
    dangling = []
    for entry in resp.entries:
        try:
            await rig.leases.GetLease(lease_pb2.GetLeaseRequest(lease_id=entry.lease_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.NOT_FOUND, exc
            dangling.append(entry.key.conversation_key)
    return len(resp.entries), dangling


async def test_gateway_kill9_mid_stream(rig: GatewayRig) -> None:
    conv = "c-gw-kill"
    msgs = [{"role": "user", "content": LONG}]
    async with httpx.AsyncClient(base_url=rig.http_url, timeout=30) as http:
        answer, _ = await _turn(http, msgs, conv)  # turn 1 registers the conversation's entry
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "w12 w13 go on"}]
        await asyncio.sleep(0.5)
        entries_before, _ = await _dangling(rig)

        frames: list[str] = []
        error: str | None = None
        killed_at = 0.0
        try:
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "max_tokens": 40, "conversation_id": conv, "stream": True},
            ) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line)
                    if len(frames) == 3 and not killed_at:
                        killed_at = time.monotonic()
                        await asyncio.to_thread(rig.gateway.kill9)
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        ended_after = time.monotonic() - killed_at
        print(
            f"\ngateway kill -9 mid-stream: {len(frames)} frames, then {error or 'a clean end'} "
            f"{ended_after:.2f}s after the kill"
        )
        assert killed_at and error is not None, frames  # the stream broke: an error, not a (truncated) success
        assert "data: [DONE]" not in frames
        assert ended_after < 10

        await asyncio.sleep(ENTRY_TTL_S + 3.0)  # every entry lease the dead gateway held has lapsed
        entries_after, dangling = await _dangling(rig)
        print(
            f"registry after the entry TTL: {entries_before} entries before the kill, {entries_after} after; "
            f"entries naming an ended lease: {dangling}"
        )
        assert dangling == [] and entries_before >= 1

        rig.gateway.start()  # same ports
        answer, verdict = await _turn(http, msgs, conv)
        async with httpx.AsyncClient() as direct:
            ref = await direct.post(
                rig.decode.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 6}
            )
        expected = ref.json()["choices"][0]["message"]["content"]
        print(f"restarted gateway: next turn {verdict}, answer correct={answer == expected}")
        assert answer == expected
