"""A 3-member etcd cluster survives losing its leader."""

from __future__ import annotations

import asyncio

import pytest
from etcd3aio import Etcd3Client

from tests.fixtures.etcd import EtcdCluster

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


async def test_leader_loss_elects_new_leader_and_keeps_data(etcd_cluster: EtcdCluster) -> None:
    async with Etcd3Client(etcd_cluster.endpoints) as client:
        assert client.kv is not None
        await client.kv.put(b"/cluster/before", b"1", timeout=5)

    old_leader = etcd_cluster.leader()
    etcd_cluster.kill_member(old_leader)
    new_leader = await asyncio.to_thread(etcd_cluster.leader)
    assert new_leader != old_leader

    async with Etcd3Client(etcd_cluster.live_endpoints()) as client:
        assert client.kv is not None
        await client.kv.put(b"/cluster/after", b"2", timeout=5)
        before = await client.kv.get(b"/cluster/before", timeout=5)
        assert [kv.value for kv in before.kvs] == [b"1"]

    etcd_cluster.restart_member(old_leader)
    async with Etcd3Client([etcd_cluster.endpoints[old_leader]]) as client:
        assert client.kv is not None
        after = await client.kv.get(b"/cluster/after", timeout=5)
        assert [kv.value for kv in after.kvs] == [b"2"]


async def test_etcd_store_fails_over_and_watch_resumes_without_gaps(etcd_cluster: EtcdCluster) -> None:
    from kvbridge_services.common.store.etcd import EtcdStore

    store = EtcdStore(etcd_cluster.endpoints, timeout=5.0)
    try:
        first = await store.put(b"/fo/0", b"0")
        watch = store.watch_prefix(b"/fo/", start_revision=first)
        seen = [e.kv.key for e in (await anext(watch)).events]
        etcd_cluster.kill_member(etcd_cluster.leader())
        # A write in flight while the leader dies has an unknown outcome (StoreUnavailable); wait for a
        # new leader first, as a caller retrying after StoreUnavailable would.
        await asyncio.to_thread(etcd_cluster.leader)
        for i in range(1, 6):
            await store.put(f"/fo/{i}".encode(), b"x")  # retried on the survivors within the deadline
        async with asyncio.timeout(15):
            while len(seen) < 6:
                seen.extend(e.kv.key for e in (await anext(watch)).events)
        assert seen == [f"/fo/{i}".encode() for i in range(6)]  # nothing missed, nothing twice
        await watch.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()
