"""Gateway + real registry + real lease manager (one MemoryStore, real gRPC) + engine simulators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from kvbridge_services.common.auth import Authenticator, Principal
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings

from tests.tools.engine_sim import SimConfig, SimServer

MODEL = "sim-model"
BLOCK = 16
SECRET_HEX = "00112233445566778899aabbccddeeff"
KEYS = {"key-acme": Principal("acme-app", "acme"), "key-globex": Principal("globex-app", "globex")}


@dataclass
class Stack:
    gateway: GatewayApp
    prefill: SimServer
    decode: SimServer
    client: httpx.AsyncClient  # talks to the gateway as tenant acme

    async def settle(self) -> None:
        """Waits for post-turn registrations so the next turn can see them."""
        await self.gateway.core.router.drain()

    async def sim_stats(self, sim: SimServer) -> dict:
        async with httpx.AsyncClient() as c:
            return (await c.get(sim.url + "/sim/stats")).json()


async def _wait_leader(app: LeaseApp) -> None:
    async with asyncio.timeout(10):
        while not app.is_leader:  # noqa: ASYNC110 - polling another component
            await asyncio.sleep(0.02)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    store = MemoryStore()
    lease = LeaseApp(store, LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
                     ServerSettings(shutdown_grace_s=0.2))
    await lease.start()
    await _wait_leader(lease)
    registry = RegistryApp(store, settings=RegistrySettings(port=0, lease_service_target=lease.address),
                           server_settings=ServerSettings(shutdown_grace_s=0.2))
    await registry.start()
    p = SimServer(SimConfig(role="prefill", engine_id="p0", model=MODEL, block_size=BLOCK))
    d = SimServer(SimConfig(role="decode", engine_id="d0", model=MODEL, block_size=BLOCK))
    await p.__aenter__()
    await d.__aenter__()
    settings = GatewaySettings(
        host="127.0.0.1", http_port=0, grpc_port=0, registry_address=registry.address,
        lease_address=lease.address, hash_secret_hex=SECRET_HEX, default_block_size=BLOCK,
        prefill_engines=[StaticEngine(url=p.url, model=MODEL, engine_id="p0", kv_host="127.0.0.1",
                                      kv_port=p.cfg.port, block_size=BLOCK, register_in_registry=True)],
        decode_engines=[StaticEngine(url=d.url, model=MODEL, engine_id="d0", kv_host="127.0.0.1",
                                     kv_port=d.cfg.port, block_size=BLOCK, register_in_registry=True)],
        engines_from_registry=False, health_interval_s=0.5)
    gw = GatewayApp(settings, auth=Authenticator(KEYS))
    await gw.start()
    client = httpx.AsyncClient(base_url=gw.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30)
    try:
        yield Stack(gw, p, d, client)
    finally:
        await client.aclose()
        await gw.stop()
        await d.__aexit__(None, None, None)
        await p.__aexit__(None, None, None)
        await registry.stop(0.1)
        await lease.stop(0.1)
        await store.close()
