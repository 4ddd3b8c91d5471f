"""Faults under load, each test counting what was lost (target: nothing acknowledged).

- kill -9 of the registry process while writers register entries: clients see UNAVAILABLE, then recover
  after the restart; every acknowledged registration is still there.
- etcd quorum lost then restored (3 members): turns through the gateway still answer correctly
  (recompute), and reuse comes back without restarting anything.
- a decode engine killed mid-conversation: the next turn recomputes and answers correctly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration
from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings

from tests.fixtures.control_plane_procs import _spawn, _stop, _wait_for_grpc
from tests.fixtures.etcd import EtcdCluster, EtcdServer, free_port
from tests.tools.engine_sim import SimConfig, SimServer

from .conftest import BLOCK, MODEL, SECRET_HEX, chain

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
LONG = " ".join(f"w{i}" for i in range(100, 200))


# ---- kill -9 of the registry under load ---------------------------------------------------------


class RegistryProcess:
    def __init__(self, etcd: str, lease_target: str, log_dir: Path) -> None:
        self.port = free_port()
        self.env = {**os.environ, "KVBRIDGE_ETCD_ENDPOINTS": etcd, "KVBRIDGE_HOST": "127.0.0.1",
                    "KVBRIDGE_REGISTRY_PORT": str(self.port), "KVBRIDGE_REGISTRY_LEASE_SERVICE_TARGET": lease_target,
                    "KVBRIDGE_REGISTRY_METRICS_PORT": "0"}
        self.env.pop("KVBRIDGE_API_KEYS_FILE", None)
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = self.log_dir / f"registry-{self.starts}.log"
        self.proc = _spawn("kvbridge_services.registry", self.env, log)
        _wait_for_grpc(self.target, self.proc, log)

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
async def killable_registry(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[tuple[RegistryProcess, str]]:
    lease_port = free_port()
    reg = RegistryProcess(etcd_server.endpoint, f"127.0.0.1:{lease_port}", tmp_path)  # ports picked before binding
    env = {**os.environ, "KVBRIDGE_ETCD_ENDPOINTS": etcd_server.endpoint, "KVBRIDGE_HOST": "127.0.0.1",
           "KVBRIDGE_LEASE_PORT": str(lease_port)}
    env.pop("KVBRIDGE_API_KEYS_FILE", None)
    lease_proc = _spawn("kvbridge_services.lease", env, tmp_path / "lease.log")
    try:
        _wait_for_grpc(f"127.0.0.1:{lease_port}", lease_proc, tmp_path / "lease.log")
        reg.start()
        async with asyncio.timeout(20):  # the lease manager answers once elected
            while b"leader" not in (tmp_path / "lease.log").read_bytes():  # noqa: ASYNC110 - a log file
                await asyncio.sleep(0.1)
        yield reg, f"127.0.0.1:{lease_port}"
    finally:
        if reg.proc is not None and reg.proc.poll() is None:
            _stop(reg.proc)
        _stop(lease_proc)


async def test_registry_kill9_under_load_loses_nothing_acknowledged(
        killable_registry: tuple[RegistryProcess, str]) -> None:
    reg, lease_target = killable_registry
    lease_ch = grpc.aio.insecure_channel(lease_target)
    leases = lease_pb2_grpc.LeaseServiceStub(lease_ch)
    node = await leases.GrantLease(lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d0",
                                                               ttl=Duration(seconds=120)), timeout=10)
    reg_ch = grpc.aio.insecure_channel(reg.target)
    registry = registry_pb2_grpc.RegistryServiceStub(reg_ch)
    await registry.RegisterEngine(registry_pb2.RegisterEngineRequest(engine=types_pb2.Engine(
        engine_id="d0", role=types_pb2.ENGINE_ROLE_DECODE, model=MODEL, http_url="http://127.0.0.1:9",
        kv_host="127.0.0.1", kv_port=9, dp_size=1, tp_size=1, block_size=BLOCK, kv_group_count=1,
        node_lease_id=node.lease.lease_id)), timeout=10)
    tokens = list(range(20, 20 + 4 * BLOCK))
    acked: list[str] = []
    errors: dict[str, int] = {}
    stop = asyncio.Event()

    async def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            conv = f"w{w}-{i}"
            i += 1
            try:
                lease = await leases.GrantLease(lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_ENTRY, tenant="acme", engine_id="d0", model=MODEL,
                    conversation_key=conv, ttl=Duration(seconds=300)), timeout=5)
                await registry.RegisterEntry(registry_pb2.RegisterEntryRequest(
                    request_id=f"rq-{conv}", entry=registry_pb2.Entry(
                        key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv),
                        engine_id="d0", engine_request_id=f"r-{conv}", block_ids=[types_pb2.BlockIds(ids=[1, 2, 3, 4])],
                        block_size=BLOCK, token_count=4 * BLOCK, block_hashes=chain(tokens, "acme"),
                        lease_id=lease.lease.lease_id, epoch=1)), timeout=2)
                acked.append(conv)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                await asyncio.sleep(0.05)

    writers = [asyncio.create_task(writer(w)) for w in range(4)]
    await asyncio.sleep(2.0)
    acked_before_kill = len(acked)
    await asyncio.to_thread(reg.kill9)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(reg.start)  # same port: clients reconnect on their own
    deadline = time.monotonic() + 30
    while len(acked) < acked_before_kill + 50 and time.monotonic() < deadline:  # noqa: ASYNC110 - polling
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*writers)
    assert errors.get("UNAVAILABLE", 0) > 0, errors  # the outage was seen ...
    assert set(errors) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED"}, errors  # ... and nothing else
    assert len(acked) >= acked_before_kill + 50, "no recovery after the restart"
    lost = []
    for conv in acked:
        try:
            await registry.GetEntry(registry_pb2.GetEntryRequest(
                key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv)), timeout=5)
        except grpc.aio.AioRpcError as exc:
            lost.append((conv, from_rpc_error(exc).reason))
    print(f"registry kill -9: acknowledged={len(acked)} lost={len(lost)} client errors={errors}")
    assert lost == []
    await reg_ch.close()
    await lease_ch.close()


# ---- gateway stacks on etcd / with two decode engines ---------------------------------------


async def _wait_leader(app: LeaseApp) -> None:
    async with asyncio.timeout(20):
        while not app.is_leader:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


class Stack:
    def __init__(self, store: Any, decodes: int = 1) -> None:
        self.store = store
        self.decodes = decodes

    async def __aenter__(self) -> Stack:
        server = ServerSettings(shutdown_grace_s=0.2)
        self.lease = LeaseApp(self.store, LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5,
                                                      store_timeout_s=1.0), server)
        await self.lease.start()
        await _wait_leader(self.lease)
        self.registry = RegistryApp(self.store, settings=RegistrySettings(port=0,
                                                                          lease_service_target=self.lease.address),
                                    server_settings=server, store_timeout_s=1.0)
        await self.registry.start()
        self.prefill = SimServer(SimConfig(role="prefill", engine_id="p0", model=MODEL, block_size=BLOCK))
        self.decode = [SimServer(SimConfig(role="decode", engine_id=f"d{i}", model=MODEL, block_size=BLOCK))
                       for i in range(self.decodes)]
        for sim in (self.prefill, *self.decode):
            await sim.__aenter__()
        settings = GatewaySettings(
            host="127.0.0.1", http_port=0, grpc_port=0, registry_address=self.registry.address,
            lease_address=self.lease.address, hash_secret_hex=SECRET_HEX, default_block_size=BLOCK,
            reuse_threshold_tokens=BLOCK, control_timeout_s=0.5, health_interval_s=0.3, health_timeout_s=0.3,
            prefill_engines=[StaticEngine(url=self.prefill.url, model=MODEL, engine_id="p0", kv_host="127.0.0.1",
                                          kv_port=self.prefill.cfg.port, block_size=BLOCK,
                                          register_in_registry=True)],
            decode_engines=[StaticEngine(url=d.url, model=MODEL, engine_id=d.cfg.engine_id, kv_host="127.0.0.1",
                                         kv_port=d.cfg.port, block_size=BLOCK, register_in_registry=True)
                            for d in self.decode],
            engines_from_registry=False)
        self.gateway = GatewayApp(settings)
        await self.gateway.start()
        self.client = httpx.AsyncClient(base_url=self.gateway.http_url, timeout=30)
        self.stopped: set[int] = set()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        await self.gateway.stop()
        for i, sim in enumerate(self.decode):
            if i not in self.stopped:
                await sim.__aexit__(None, None, None)
        await self.prefill.__aexit__(None, None, None)
        await self.registry.stop(0.1)
        await self.lease.stop(0.1)

    async def turn(self, messages: list[dict[str, str]], conv: str) -> tuple[str, str]:
        r = await self.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 8, "conversation_id": conv})
        assert r.status_code == 200, r.text
        await self.gateway.core.router.drain()
        return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]

    async def reference(self, messages: list[dict[str, str]]) -> str:
        sim = next(d for i, d in enumerate(self.decode) if i not in self.stopped)
        async with httpx.AsyncClient() as c:
            r = await c.post(sim.url + "/v1/chat/completions",
                             json={"model": MODEL, "messages": messages, "max_tokens": 8})
        return str(r.json()["choices"][0]["message"]["content"])


async def _conversation(stack: Stack, conv: str, turns: int, history: list[dict[str, str]] | None = None
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


async def test_decode_engine_killed_mid_conversation(tmp_path: Path) -> None:
    store = MemoryStore()
    async with Stack(store, decodes=2) as stack:
        msgs, verdicts, wrong = await _conversation(stack, "c-kill", 2)
        assert verdicts[-1].startswith("hit;") and wrong == 0
        held_by = next(i for i, d in enumerate(stack.decode) if d.engine.kv.held)
        await stack.decode[held_by].__aexit__(None, None, None)  # the engine holding the conversation's KV dies
        stack.stopped.add(held_by)
        await asyncio.sleep(1.0)  # health checks notice
        msgs, verdicts, wrong = await _conversation(stack, "c-kill", 2, msgs)
        print(f"decode killed: verdicts after={verdicts} wrong answers={wrong}")
        assert wrong == 0
        assert not verdicts[0].startswith("hit;")  # recomputed ...
        assert verdicts[1].startswith("hit;")  # ... and reuse resumes on the surviving engine
    await store.close()


async def test_etcd_quorum_lost_then_restored(etcd_cluster: EtcdCluster) -> None:
    from kvbridge_services.common.store.etcd import EtcdStore

    store = EtcdStore(etcd_cluster.endpoints)
    try:
        async with Stack(store) as stack:
            _, verdicts, wrong = await _conversation(stack, "c-q", 2)
            assert wrong == 0 and verdicts[-1].startswith("hit;")
            survivor = etcd_cluster.leader()
            others = [i for i in range(3) if i != survivor]
            for i in others:
                etcd_cluster.kill_member(i)
            outage_turns = 0
            outage_wrong = 0
            started = time.monotonic()
            for k in range(3):
                _, _, w = await _conversation(stack, f"c-outage-{k}", 2)
                outage_turns += 2
                outage_wrong += w
            outage_s = time.monotonic() - started
            for i in others:
                etcd_cluster.restart_member(i)
            # Recovery without a restart: a new conversation gets reuse again within a bounded time.
            recovered = False
            deadline = time.monotonic() + 60
            while not recovered and time.monotonic() < deadline:
                _, verdicts, w = await _conversation(stack, f"c-after-{int(time.monotonic() * 1000)}", 2)
                outage_wrong += w
                recovered = verdicts[-1].startswith("hit;")
            print(f"quorum lost: {outage_turns} turns in {outage_s:.1f}s, wrong answers={outage_wrong}, "
                  f"recovered={recovered}")
            assert outage_wrong == 0
            assert recovered
    finally:
        await store.close()

