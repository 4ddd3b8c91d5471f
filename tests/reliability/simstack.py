"""An in-process stack for fault tests: lease manager + registry on a given store, engine simulators as
P and D, and the gateway (settings overridable), driven over HTTP."""

from __future__ import annotations

from typing import Any

import grpc
import httpx

from kvbridge.lease.v1 import lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2_grpc
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.tools.engine_sim import SimConfig, SimServer

from .conftest import BLOCK, MODEL, SECRET_HEX

LONG = " ".join(f"w{i}" for i in range(100, 200))


def _static(sim: SimServer) -> StaticEngine:
    return StaticEngine(
        url=sim.url,
        model=MODEL,
        engine_id=sim.cfg.engine_id,
        kv_host="127.0.0.1",
        kv_port=sim.cfg.port,
        block_size=BLOCK,
        register_in_registry=True,
    )


class Stack:
    """``prefills``/``decodes`` simulators; ``gateway`` overrides GatewaySettings fields."""

    def __init__(self, store: Any, decodes: int = 1, prefills: int = 1, **gateway: Any) -> None:
        self.store = store
        self.decodes = decodes
        self.prefills = prefills
        self.overrides = gateway

    async def __aenter__(self) -> Stack:
        self.prefill_sims = [
            SimServer(SimConfig(role="prefill", engine_id=f"p{i}", model=MODEL, block_size=BLOCK))
            for i in range(self.prefills)
        ]
        self.prefill = self.prefill_sims[0]
        self.decode = [
            SimServer(SimConfig(role="decode", engine_id=f"d{i}", model=MODEL, block_size=BLOCK))
            for i in range(self.decodes)
        ]
        self.stopped: set[int] = set()
        started: list[SimServer] = []
        try:
            for sim in (*self.prefill_sims, *self.decode):
                await sim.__aenter__()
                started.append(sim)
            settings = GatewaySettings(
                host="127.0.0.1",
                http_port=0,
                grpc_port=0,
                hash_secret_hex=SECRET_HEX,
                default_block_size=BLOCK,
                reuse_threshold_tokens=BLOCK,
                control_timeout_s=0.5,
                health_interval_s=0.3,
                health_timeout_s=0.3,
                prefill_engines=[_static(p) for p in self.prefill_sims],
                decode_engines=[_static(d) for d in self.decode],
                engines_from_registry=False,
                **self.overrides,
            )
            self.services = ServiceStack(
                self.store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5, store_timeout_s=1.0),
                registry=RegistrySettings(port=0),
                gateway=settings,
                server=ServerSettings(shutdown_grace_s=0.2),
                registry_store_timeout_s=1.0,
                leader_timeout_s=20,
                stop_grace_s=0.1,
            )
            await self.services.start()
        except BaseException:
            for sim in reversed(started):
                await sim.__aexit__(None, None, None)
            raise
        assert self.services.lease and self.services.registry and self.services.gateway
        self.lease, self.registry, self.gateway = self.services.lease, self.services.registry, self.services.gateway
        self.client = httpx.AsyncClient(base_url=self.gateway.http_url, timeout=30)
        self.channels = [grpc.aio.insecure_channel(a) for a in (self.lease.address, self.registry.address)]
        self.lease_stub = lease_pb2_grpc.LeaseServiceStub(self.channels[0])
        self.registry_stub = registry_pb2_grpc.RegistryServiceStub(self.channels[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        for channel in self.channels:
            await channel.close()
        await self.services.stop()
        for i, sim in enumerate(self.decode):
            if i not in self.stopped:
                await sim.__aexit__(None, None, None)
        for sim in self.prefill_sims:
            await sim.__aexit__(None, None, None)

    async def turn(self, messages: list[dict[str, str]], conv: str) -> tuple[str, str]:
        r = await self.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 8, "conversation_id": conv},
        )
        assert r.status_code == 200, r.text
        await self.gateway.core.router.drain()
        return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]

    async def reference(self, messages: list[dict[str, str]]) -> str:
        sim = next(d for i, d in enumerate(self.decode) if i not in self.stopped)
        async with httpx.AsyncClient() as c:
            r = await c.post(
                sim.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}
            )
        return str(r.json()["choices"][0]["message"]["content"])


async def conversation(
    stack: Stack, conv: str, turns: int, history: list[dict[str, str]] | None = None
) -> tuple[list[dict[str, str]], list[str], int]:
    """Runs turns; returns the history, the verdicts, and how many answers were wrong."""
    msgs = history or [{"role": "user", "content": LONG}]
    verdicts: list[str] = []
    wrong = 0
    for t in range(turns):
        answer, verdict = await stack.turn(msgs, conv)
        verdicts.append(verdict)
        wrong += answer != await stack.reference(msgs)
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": f"turn {t}"}]
    return msgs, verdicts, wrong
