"""The gateway's and the connector's lease clients (the SDK's LeaseClient) pointed at a standby lease manager:
they follow its NOT_LEADER to the leader and keep renewing. Real registry + leader processes on real etcd;
the standby is a second lease manager in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_connector import control_plane as connector_cp
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.gateway.control import ControlPlane
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from tests.fixtures.control_plane_procs import ControlPlaneProcs, run_control_plane

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
NODE_TTL_S = 1.0


@pytest.fixture
async def standby(tmp_path: Path) -> AsyncIterator[tuple[ControlPlaneProcs, LeaseApp]]:
    with run_control_plane(tmp_path) as procs:
        store = EtcdStore([procs.etcd.endpoint])
        app = LeaseApp(
            store, LeasePolicy(port=0, leader_ttl_s=15, leader_refresh_s=1), ServerSettings(shutdown_grace_s=0.2)
        )
        await app.start()
        try:
            async with grpc.aio.insecure_channel(app.address) as channel:  # the standby says who leads
                async with asyncio.timeout(20):
                    while True:
                        try:
                            await lease_pb2_grpc.LeaseServiceStub(channel).ListLeases(
                                lease_pb2.ListLeasesRequest(page_size=1), timeout=2
                            )
                        except grpc.aio.AioRpcError as exc:
                            if from_rpc_error(exc).metadata.get("leader") == procs.lease_target:
                                break
                        await asyncio.sleep(0.1)
            assert not app.is_leader
            yield procs, app
        finally:
            await app.stop(0.2)
            await store.close()


async def _node_leases(leader: str, engine_id: str) -> list[lease_pb2.Lease]:
    async with grpc.aio.insecure_channel(leader) as channel:
        resp = await lease_pb2_grpc.LeaseServiceStub(channel).ListLeases(
            lease_pb2.ListLeasesRequest(engine_id=engine_id, kind=lease_pb2.LEASE_KIND_NODE), timeout=5
        )
    return list(resp.leases)


async def test_gateway_lease_calls_and_keepalive_stream_follow_the_leader(
    standby: tuple[ControlPlaneProcs, LeaseApp],
) -> None:
    _, app = standby
    control = ControlPlane("", app.address, api_key=None, timeout_s=2)
    streams = ControlPlane("", app.address, api_key=None, timeout_s=2)
    try:
        lease_id = await control.grant_lease(
            kind=lease_pb2.LEASE_KIND_ENTRY, tenant="acme", engine_id="d0", model="m", conversation_key="c1", ttl_s=1.0
        )
        for _ in range(8):  # 4 TTLs
            statuses = await control.keep_alive(lease_ids=[lease_id])
            assert [s.alive for s in statuses] == [True]
            await asyncio.sleep(0.5)
        # A KeepAlive stream (the conversation renewer's) first goes to the standby; its NOT_LEADER moves the
        # client, and the next stream renews at the leader.
        refs = [lease_pb2.ConversationRef(tenant="acme", model="m", conversation_key="c1")]
        results: list[str] = []
        for _ in range(2):
            call = streams.open_keep_alive(timeout_s=5)
            try:
                await call.write(lease_pb2.KeepAliveRequest(conversations=refs))
                resp = await call.read()
                assert isinstance(resp, lease_pb2.KeepAliveResponse)
                results.append("alive" if resp.statuses[0].alive else "gone")
            except grpc.aio.AioRpcError as exc:
                results.append(from_rpc_error(exc).reason)
                streams.lease_stream_failed(exc)
            finally:
                call.cancel()
        assert results == ["NOT_LEADER", "alive"]
    finally:
        await control.close()
        await streams.close()


async def test_connector_control_plane_registers_and_keeps_its_node_lease_via_a_standby(
    standby: tuple[ControlPlaneProcs, LeaseApp],
) -> None:
    procs, app = standby
    engine = types_pb2.Engine(
        engine_id="decode-standby",
        role=types_pb2.ENGINE_ROLE_DECODE,
        model="tiny",
        kv_host="127.0.0.1",
        kv_port=5555,
        block_size=32,
        kv_group_count=1,
        total_kv_blocks=1000,
        dp_size=1,
        tp_size=1,
        pp_size=1,
        dcp_size=1,
    )
    settings = ConnectorSettings(
        registry_target=procs.registry_target,
        lease_target=app.address,
        hash_secret=b"integration-secret-0123456789",
        node_lease_ttl_s=NODE_TTL_S,
    )
    plane = connector_cp.ControlPlane(settings, engine)
    plane.start()
    try:
        events: list[connector_cp.Event] = []
        async with asyncio.timeout(30):  # polled without blocking: the standby runs on this loop
            while not any(isinstance(e, connector_cp.Connection) and e.up for e in events):
                events.extend(plane.drain())
                await asyncio.sleep(0.05)
        async with asyncio.timeout(30):
            while not (first := await _node_leases(procs.lease_target, engine.engine_id)):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.sleep(4 * NODE_TTL_S)
        later = await _node_leases(procs.lease_target, engine.engine_id)
        print(
            f"\nconnector via standby: node lease {first[0].lease_id} alive after "
            f"{time.monotonic() - started:.1f}s (4 TTLs), renewed through the leader"
        )
        # The same node lease, renewed all along (a lapse would have re-registered under a new one).
        assert [le.lease_id for le in later] == [first[0].lease_id]
        assert later[0].last_renew_time.ToNanoseconds() > first[0].last_renew_time.ToNanoseconds()
    finally:
        await asyncio.to_thread(plane.stop)
