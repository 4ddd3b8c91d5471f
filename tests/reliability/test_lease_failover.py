"""kill -9 of the lease-manager leader with two replicas (real processes on one etcd).

The SDK client is given both replicas. Before the kill it holds acknowledged leases kept alive by a
Heartbeater over one KeepAlive stream, plus one short lease that nobody renews. After the kill:
the follower takes over (failover time printed), every acknowledged lease still exists and stays alive
through the SDK's re-opened KeepAlive stream, and the unrenewed lease still expires, no later than its
TTL after the takeover (the takeover never shortens a lease, so it may outlive its original deadline by
the failover time at most).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvbridge.errors import KvbridgeError
from kvbridge.lease.v1 import lease_pb2
from kvbridge.sdk import ClientOptions
from kvbridge.sdk.lease import Heartbeater, LeaseClient
from tests.fixtures.etcd import EtcdServer

from .procs import ServiceProcess, lease_process

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
RENEWED_TTL_S = 6.0  # short: a heartbeater that did not reconnect would lose these leases during the test
ORPHAN_TTL_S = 4.0
LEADER_TTL_S = 2


@pytest.fixture
async def replicas(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[list[ServiceProcess]]:
    procs = [
        lease_process(
            etcd_server.endpoint,
            tmp_path,
            name=f"lease-{n}",
            KVBRIDGE_LEASE_LEADER_TTL_S=str(LEADER_TTL_S),
            KVBRIDGE_LEASE_LEADER_REFRESH_S="0.5",
        )
        for n in "ab"
    ]
    try:
        procs[0].start()
        await _serving(procs[0].target)  # a is the leader before b starts
        procs[1].start()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


async def _serving(target: str, bound_s: float = 60.0) -> float:
    """Waits until ``target`` itself answers as the leader (no redirect); returns when it did."""
    client = LeaseClient(target, ClientOptions(max_attempts=1, timeout_s=2))
    try:
        async with asyncio.timeout(bound_s):
            while True:
                try:
                    await client.list_leases(page_size=1)
                    return time.monotonic()
                except KvbridgeError as err:
                    assert err.code is grpc.StatusCode.UNAVAILABLE, err
                    await asyncio.sleep(0.05)
    finally:
        await client.close()


@pytest.mark.parametrize("first_contact", ["leader", "follower"])
async def test_lease_leader_kill9_follower_takes_over(replicas: list[ServiceProcess], first_contact: str) -> None:
    leader, follower = replicas
    # Both replicas in one target (as a DNS name with two records would give), tried in order: first the
    # leader (no redirect; after the kill the channel moves on to the other address), or first the follower
    # (its NOT_LEADER names the leader and the SDK redirects there, before the leader dies; after the kill the
    # client and the Heartbeater fall back from that dead address to the configured target).
    order = [leader, follower] if first_contact == "leader" else [follower, leader]
    client = LeaseClient(
        f"ipv4:{order[0].target},{order[1].target}", ClientOptions(timeout_s=2, max_attempts=30, backoff_max_s=0.5)
    )
    lost: list[int] = []
    beat = Heartbeater(client, interval_s=0.5, on_lost=lambda s: lost.append(s.lease_id))
    try:
        acked = []
        for i in range(20):
            resp = await client.grant(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant="acme",
                engine_id="d0",
                model="sim-model",
                conversation_key=f"c{i}",
                ttl_s=RENEWED_TTL_S,
                request_id=f"rq-{i}",
            )
            acked.append(resp.lease.lease_id)
            beat.add_lease(resp.lease.lease_id)
        beat.start()
        orphan = await client.grant(
            kind=lease_pb2.LEASE_KIND_ENTRY,
            tenant="acme",
            engine_id="d0",
            model="sim-model",
            conversation_key="orphan",
            ttl_s=ORPHAN_TTL_S,
        )
        await asyncio.sleep(1.0)
        streams_before = beat.streams_opened

        killed_at = time.monotonic()
        await asyncio.to_thread(leader.kill9)
        served_at = await _serving(follower.target)
        failover_s = served_at - killed_at
        gone_at = await _expired(client, orphan.lease.lease_id, bound_s=failover_s + ORPHAN_TTL_S + 10)
        orphan_late_s = gone_at - (killed_at - 1.0 + ORPHAN_TTL_S)  # vs. its deadline before the failover
        await asyncio.sleep(max(0.0, killed_at + 3 * RENEWED_TTL_S - time.monotonic()))  # past every TTL
        alive = [(await client.get(lease_id)).lease_id for lease_id in acked]
        print(
            f"\nlease-manager leader kill -9: failover {failover_s:.2f}s (leader TTL {LEADER_TTL_S}s); "
            f"acknowledged leases alive {len(alive)}/{len(acked)}; KeepAlive streams opened "
            f"{beat.streams_opened} (before the kill {streams_before}); unrenewed {ORPHAN_TTL_S:.0f}s lease "
            f"expired {gone_at - killed_at:.2f}s after the kill ({orphan_late_s:+.2f}s vs its original deadline)"
        )
        assert alive == acked and lost == []
        assert beat.streams_opened > streams_before  # the stream broke with the leader and was re-opened
        assert gone_at - served_at <= ORPHAN_TTL_S + 2.0  # at most one TTL after the takeover (+ slack)
    finally:
        await beat.stop()
        await client.close()


async def _expired(client: LeaseClient, lease_id: int, bound_s: float) -> float:
    """Polls GetLease until the lease is gone (NOT_FOUND); returns when."""
    async with asyncio.timeout(bound_s):
        while True:
            try:
                await client.get(lease_id)
            except KvbridgeError as err:
                if err.code is grpc.StatusCode.NOT_FOUND:
                    return time.monotonic()
                raise
            await asyncio.sleep(0.1)
