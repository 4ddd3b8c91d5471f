"""Connector mode on the embedded store with a data directory, restartable: lease manager, registry and gateway
in-process (real gRPC, fixed control-plane ports across restarts) on ``MemoryStore(data_dir=...)``, and engine
simulators running the connector's real control plane (``tests/tools/sim_connector.py``) that outlive the
restarts, as engines outlive a control-plane restart or a store restore.

Used by the store-generation, lease-blip and close-race tests (issue 30)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.fixtures.common import free_port
from tests.fixtures.gateway_stack import BLOCK, KEYS, LONG, MODEL, SECRET_HEX
from tests.tools.engine_sim import SimConfig, SimServer

__all__ = ["LONG", "MODEL", "ConnectorStack", "eventually"]


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    """Polls ``check`` until true; the seconds it took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


class ConnectorStack:
    """``start_services`` / ``stop_services`` may be called again (a restart on the same files and ports);
    ``start_engines`` once, after the first ``start_services``."""

    def __init__(self, data_dir: Path, *, standby_lease: bool = False) -> None:
        self.data_dir = data_dir
        self.lease_port, self.registry_port = free_port(), free_port()
        # A second lease-manager replica on the same store (for a failover), started with the services.
        self.standby_port = free_port() if standby_lease else 0
        self.standby: LeaseApp | None = None
        self.store: MemoryStore | None = None
        self.services: ServiceStack | None = None
        self.client: httpx.AsyncClient | None = None
        self.sims: list[SimServer] = []

    @property
    def lease_target(self) -> str:
        if self.standby_port:
            return f"ipv4:127.0.0.1:{self.lease_port},127.0.0.1:{self.standby_port}"
        return f"127.0.0.1:{self.lease_port}"

    def _policy(self, port: int) -> LeasePolicy:
        return LeasePolicy(port=port, leader_ttl_s=2, leader_refresh_s=0.5, min_ttl_s=0.1, store_timeout_s=1.0)

    async def start_services(self) -> None:
        self.store = MemoryStore(data_dir=self.data_dir)
        gateway = GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            hash_secret_hex=SECRET_HEX,
            default_block_size=BLOCK,
            engines_from_registry=True,
            registry_refresh_s=0.2,
            health_interval_s=0.5,
            control_timeout_s=1.0,
        )
        self.services = ServiceStack(
            self.store,
            lease_policy=self._policy(self.lease_port),
            registry=RegistrySettings(port=self.registry_port, engine_sweep_interval_s=0.5),
            gateway=gateway,
            server=ServerSettings(host="127.0.0.1", shutdown_grace_s=0.2),
            gateway_auth=Authenticator(KEYS),
            leader_timeout_s=30,
            stop_grace_s=0.1,
        )
        await self.services.start()
        if self.standby_port:
            self.standby = LeaseApp(
                self.store, self._policy(self.standby_port), ServerSettings(host="127.0.0.1", shutdown_grace_s=0.2)
            )
            await self.standby.start()
        assert self.services.gateway is not None
        self.client = httpx.AsyncClient(
            base_url=self.services.gateway.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30
        )

    async def stop_services(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.services is not None:
            await self.services.stop()
            self.services = None
        if self.standby is not None:
            await self.standby.stop(0.1)
            self.standby = None
        if self.store is not None:
            await self.store.close()
            self.store = None

    async def fail_over(self) -> float:
        """The lease-manager leader dies as in a crash: its server goes, and its leader key is left to expire (no
        resignation), so clients get refused or NOT_LEADER until the standby is elected. The seconds until then."""
        assert self.services is not None and self.services.lease is not None and self.standby is not None
        leader = self.services.lease
        self.services._started = [s for s in self.services._started if s[0] != "lease manager"]
        await leader.server.stop(0)
        leader.election._store_lease = 0  # its step-down then revokes nothing: the key lives out its TTL
        task = leader._election_task
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        leader.metrics_endpoint.stop()
        standby = self.standby
        return await eventually(lambda: standby.is_leader, "the standby lease manager leads")

    async def start_engines(self) -> None:
        config = {
            "kvbridge_registry": f"127.0.0.1:{self.registry_port}",
            "kvbridge_lease": self.lease_target,
            "kvbridge_hash_secret": SECRET_HEX,
            "kvbridge_node_lease_ttl_s": 5,
            "kvbridge_offer_window_s": 0.5,
            "kvbridge_index_max_lag_s": 0.5,
            "kvbridge_free_grace_s": 2,
            "kvbridge_rpc_deadline_s": 1.0,
        }
        for role, engine_id in (("prefill", "p0"), ("decode", "d0")):
            sim = SimServer(
                SimConfig(role=role, engine_id=engine_id, model=MODEL, block_size=BLOCK, kvbridge_config=config)
            )
            await sim.__aenter__()
            self.sims.append(sim)
        await self.wait_for_engines()

    async def stop_engines(self) -> None:
        for sim in reversed(self.sims):
            await sim.__aexit__(None, None, None)
        self.sims = []

    @property
    def prefill(self) -> SimServer:
        return self.sims[0]

    @property
    def decode(self) -> SimServer:
        return self.sims[1]

    async def wait_for_engines(self, timeout_s: float = 30.0) -> None:
        assert self.services is not None and self.services.gateway is not None
        pool = self.services.gateway.core.pool
        await eventually(
            lambda: sum(1 for e in pool.all() if e.healthy) >= 2, "the gateway routes to P and D", timeout_s
        )

    def d_connector(self) -> Any:
        connector = self.decode.engine.connector
        assert connector is not None
        return connector

    async def wait_registered(self, count: int) -> None:
        d = self.decode.engine

        def registered() -> bool:
            d.sync_connector()
            return bool(self.d_connector().registered >= count)

        await eventually(registered, f"D registered {count} entries")

    async def wait_held(self, count: int) -> None:
        d = self.decode.engine

        def held() -> bool:
            d.sync_connector()
            return len(d.kv.held) == count

        await eventually(held, f"D holds {count} retained requests")

    async def turn(self, messages: list[dict[str, str]], conv: str, key: str = "key-acme") -> tuple[str, str]:
        assert self.client is not None and self.services is not None and self.services.gateway is not None
        r = await self.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 8, "conversation_id": conv},
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        await self.services.gateway.core.router.drain()
        return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]

    async def reference(self, messages: list[dict[str, str]]) -> str:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                self.decode.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}
            )
        return str(r.json()["choices"][0]["message"]["content"])

    async def unsafe_reads(self) -> int:
        async with httpx.AsyncClient() as c:
            return int((await c.get(self.decode.url + "/sim/stats")).json()["unsafe_reads"])

    async def delete_entry(self, tenant: str, conv: str) -> None:
        """The conversation closed at the registry: entry deleted, its lease revoked (D frees after the grace)."""
        assert self.services is not None and self.services.registry is not None
        import grpc

        from kvbridge.registry.v1 import registry_pb2_grpc

        async with grpc.aio.insecure_channel(self.services.registry.address) as channel:
            await registry_pb2_grpc.RegistryServiceStub(channel).DeleteEntry(
                registry_pb2.DeleteEntryRequest(
                    key=registry_pb2.EntryKey(tenant=tenant, model=MODEL, conversation_key=conv)
                ),
                timeout=5,
            )
