"""Faults under load, each test counting what was lost (target: nothing acknowledged).

- kill -9 of the registry process while writers register entries: clients see UNAVAILABLE, then recover
  after the restart; every acknowledged registration is still there.
- etcd quorum lost then restored (3 members): turns through the gateway still answer correctly
  (recompute), and reuse comes back without restarting anything.
- a decode engine killed mid-conversation: the next turn recomputes and answers correctly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.memory import MemoryStore
from tests.fixtures.etcd import EtcdCluster, EtcdServer

from .conftest import BLOCK, MODEL, chain
from .procs import ServiceProcess, lease_process, registry_process
from .simstack import Stack, conversation

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


# ---- kill -9 of the registry under load ---------------------------------------------------------


@pytest.fixture
async def killable_registry(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[tuple[ServiceProcess, str]]:
    lease = lease_process(etcd_server.endpoint, tmp_path)
    reg = registry_process(etcd_server.endpoint, lease.target, tmp_path)
    try:
        lease.start()
        reg.start()
        async with asyncio.timeout(20):  # the lease manager answers once elected
            while b"leader" not in lease.log.read_bytes():  # noqa: ASYNC110 - a log file
                await asyncio.sleep(0.1)
        yield reg, lease.target
    finally:
        reg.stop()
        lease.stop()


async def test_registry_kill9_under_load_loses_nothing_acknowledged(
    killable_registry: tuple[ServiceProcess, str],
) -> None:
    reg, lease_target = killable_registry
    lease_ch = grpc.aio.insecure_channel(lease_target)
    leases = lease_pb2_grpc.LeaseServiceStub(lease_ch)
    node = await leases.GrantLease(
        lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d0", ttl=Duration(seconds=120)),
        timeout=10,
    )
    reg_ch = grpc.aio.insecure_channel(reg.target)
    registry = registry_pb2_grpc.RegistryServiceStub(reg_ch)
    await registry.RegisterEngine(
        registry_pb2.RegisterEngineRequest(
            engine=types_pb2.Engine(
                engine_id="d0",
                role=types_pb2.ENGINE_ROLE_DECODE,
                model=MODEL,
                http_url="http://127.0.0.1:9",
                kv_host="127.0.0.1",
                kv_port=9,
                dp_size=1,
                tp_size=1,
                block_size=BLOCK,
                kv_group_count=1,
                node_lease_id=node.lease.lease_id,
            )
        ),
        timeout=10,
    )
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
                lease = await leases.GrantLease(
                    lease_pb2.GrantLeaseRequest(
                        kind=lease_pb2.LEASE_KIND_ENTRY,
                        tenant="acme",
                        engine_id="d0",
                        model=MODEL,
                        conversation_key=conv,
                        ttl=Duration(seconds=300),
                    ),
                    timeout=5,
                )
                await registry.RegisterEntry(
                    registry_pb2.RegisterEntryRequest(
                        request_id=f"rq-{conv}",
                        entry=registry_pb2.Entry(
                            key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv),
                            engine_id="d0",
                            engine_request_id=f"r-{conv}",
                            block_ids=[types_pb2.BlockIds(ids=[1, 2, 3, 4])],
                            block_size=BLOCK,
                            token_count=4 * BLOCK,
                            block_hashes=chain(tokens, "acme"),
                            lease_id=lease.lease.lease_id,
                            epoch=1,
                        ),
                    ),
                    timeout=2,
                )
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
            await registry.GetEntry(
                registry_pb2.GetEntryRequest(
                    key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv)
                ),
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            lost.append((conv, from_rpc_error(exc).reason))
    print(f"registry kill -9: acknowledged={len(acked)} lost={len(lost)} client errors={errors}")
    assert lost == []
    await reg_ch.close()
    await lease_ch.close()


# ---- gateway stacks on etcd / with two decode engines ---------------------------------------


async def test_decode_engine_killed_mid_conversation(tmp_path: Path) -> None:
    store = MemoryStore()
    async with Stack(store, decodes=2) as stack:
        msgs, verdicts, wrong = await conversation(stack, "c-kill", 2)
        assert verdicts[-1].startswith("hit;") and wrong == 0
        held_by = next(i for i, d in enumerate(stack.decode) if d.engine.kv.held)
        await stack.decode[held_by].__aexit__(None, None, None)  # the engine holding the conversation's KV dies
        stack.stopped.add(held_by)
        await asyncio.sleep(1.0)  # health checks notice
        msgs, verdicts, wrong = await conversation(stack, "c-kill", 2, msgs)
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
            _, verdicts, wrong = await conversation(stack, "c-q", 2)
            assert wrong == 0 and verdicts[-1].startswith("hit;")
            survivor = etcd_cluster.leader()
            others = [i for i in range(3) if i != survivor]
            for i in others:
                etcd_cluster.kill_member(i)
            outage_turns = 0
            outage_wrong = 0
            started = time.monotonic()
            for k in range(3):
                _, _, w = await conversation(stack, f"c-outage-{k}", 2)
                outage_turns += 2
                outage_wrong += w
            outage_s = time.monotonic() - started
            for i in others:
                etcd_cluster.restart_member(i)
            # Recovery without a restart: a new conversation gets reuse again within a bounded time.
            recovered = False
            deadline = time.monotonic() + 60
            while not recovered and time.monotonic() < deadline:
                _, verdicts, w = await conversation(stack, f"c-after-{int(time.monotonic() * 1000)}", 2)
                outage_wrong += w
                recovered = verdicts[-1].startswith("hit;")
            print(
                f"quorum lost: {outage_turns} turns in {outage_s:.1f}s, wrong answers={outage_wrong}, "
                f"recovered={recovered}"
            )
            assert outage_wrong == 0
            assert recovered
    finally:
        await store.close()
