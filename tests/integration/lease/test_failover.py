"""Two `python -m kvbridge_services.lease` processes on one etcd: kill -9 the leader."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.etcd import EtcdStore
from tests.fixtures.common import free_port, read_message

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def spawn(endpoint: str, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KVBRIDGE_ETCD_ENDPOINTS": endpoint,
        "KVBRIDGE_LEASE_PORT": str(port),
        "KVBRIDGE_LEASE_LEADER_TTL_S": "2",
        "KVBRIDGE_LEASE_LEADER_REFRESH_S": "0.5",
        "KVBRIDGE_LEASE_METRICS_PORT": "0",
    }  # two replicas on one host: the default 9152 would clash
    return subprocess.Popen(
        [sys.executable, "-m", "kvbridge_services.lease"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def grant(stub: lease_pb2_grpc.LeaseServiceAsyncStub, conv: str) -> lease_pb2.Lease:
    request = lease_pb2.GrantLeaseRequest(
        kind=lease_pb2.LEASE_KIND_ENTRY,
        tenant="acme",
        engine_id="eng-1",
        model="m",
        conversation_key=conv,
        ttl=duration_pb2.Duration(seconds=3),
    )
    return (await stub.GrantLease(request, timeout=2)).lease


@pytest.mark.serial  # a time bound (scripts/test)
async def test_kill_leader_standby_serves_within_5s_and_keeps_leases(etcd_server) -> None:
    ports = [free_port(), free_port()]
    procs = {f"127.0.0.1:{p}": spawn(etcd_server.endpoint, p) for p in ports}
    store = EtcdStore([etcd_server.endpoint])
    channels = {addr: grpc.aio.insecure_channel(addr) for addr in procs}
    stubs = {addr: lease_pb2_grpc.LeaseServiceStub(ch) for addr, ch in channels.items()}
    try:
        leader_key = KeyLayout().leader("lease")
        async with asyncio.timeout(20):
            while (kv := await store.get(leader_key)) is None:  # noqa: ASYNC110 - polls etcd
                await asyncio.sleep(0.1)
        leader = kv.value.decode()
        [standby] = [a for a in procs if a != leader]
        async with asyncio.timeout(20):
            while True:
                try:
                    leases = [await grant(stubs[leader], f"c{i}") for i in range(20)]
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
        # The standby redirects to the leader. (On an overloaded host the leader may step down and the
        # roles swap; then look again.)
        async with asyncio.timeout(30):
            while True:
                if (kv := await store.get(leader_key)) is None:  # between two leaders: look again
                    await asyncio.sleep(0.1)
                    continue
                leader = kv.value.decode()
                [standby] = [a for a in procs if a != leader]
                try:
                    await stubs[standby].GetLease(lease_pb2.GetLeaseRequest(lease_id=leases[0].lease_id), timeout=1)
                except grpc.aio.AioRpcError as exc:
                    err = from_rpc_error(exc)
                    if err.reason == "NOT_LEADER" and err.metadata.get("leader") == leader:
                        break
                await asyncio.sleep(0.1)
        call = stubs[leader].KeepAlive()
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=[le.lease_id for le in leases]))
        assert all(s.alive for s in (await read_message(call, lease_pb2.KeepAliveResponse)).statuses)
        call.cancel()

        procs[leader].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        async with asyncio.timeout(10):
            while True:
                try:
                    await grant(stubs[standby], "after-failover")
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
        took = time.monotonic() - killed_at
        print(f"standby served {took:.2f}s after kill -9 of the leader")
        assert took < 5.0, f"standby took {took:.2f}s to serve"
        call = stubs[standby].KeepAlive()
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=[le.lease_id for le in leases]))
        statuses = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert all(s.alive for s in statuses), "a lease expired early because of the failover"
        call.cancel()
    finally:
        for ch in channels.values():
            await ch.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        await store.close()
