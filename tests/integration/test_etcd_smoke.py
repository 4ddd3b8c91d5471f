"""The etcd fixture and etcd3aio against a real etcd: the operations the store relies on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from etcd3aio import Etcd3Client, prefix_range_end

from tests.fixtures.etcd import EtcdServer

pytestmark = pytest.mark.etcd


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[Etcd3Client]:
    async with Etcd3Client([etcd_server.endpoint]) as c:
        yield c


async def test_put_get(client: Etcd3Client) -> None:
    assert client.kv is not None
    put = await client.kv.put(b"/smoke/a", b"1", timeout=5)
    got = await client.kv.get(b"/smoke/a", timeout=5)
    assert [kv.value for kv in got.kvs] == [b"1"]
    assert got.kvs[0].mod_revision == put.header.revision


async def test_lease_keepalive_then_expiry_deletes_key(client: Etcd3Client) -> None:
    assert client.kv is not None and client.lease is not None
    lease = await client.lease.grant(ttl=3, timeout=5)
    await client.kv.put(b"/smoke/leased", b"x", lease=lease.ID, timeout=5)
    async with client.lease.keep_alive_context(lease.ID, ttl=3):  # renews every second
        await asyncio.sleep(4.5)  # well past the TTL: only keep-alive keeps the key
        assert (await client.kv.get(b"/smoke/leased", timeout=5)).count == 1
    for _ in range(100):  # expiry (TTL 3 s) within a generous bound
        if (await client.kv.get(b"/smoke/leased", timeout=5)).count == 0:
            break
        await asyncio.sleep(0.1)
    assert (await client.kv.get(b"/smoke/leased", timeout=5)).count == 0
    assert (await client.lease.time_to_live(lease.ID, timeout=5)).TTL == -1


async def test_watch_receives_put(client: Etcd3Client) -> None:
    assert client.kv is not None and client.watch is not None
    start = (await client.kv.get(b"/smoke/w/", timeout=5)).header.revision
    await client.kv.put(b"/smoke/w/k", b"v", timeout=5)
    stream = client.watch.watch(b"/smoke/w/", prefix_range_end(b"/smoke/w/"), start_revision=start + 1)
    try:
        async with asyncio.timeout(5):
            async for resp in stream:
                if resp.events:
                    assert resp.events[0].kv.key == b"/smoke/w/k"
                    assert resp.events[0].kv.value == b"v"
                    break
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def test_txn_compare(client: Etcd3Client) -> None:
    kv = client.kv
    assert kv is not None
    create_if_absent = [kv.txn_compare_version(b"/smoke/t", 0)]
    first = await kv.txn(create_if_absent, [kv.txn_op_put(b"/smoke/t", b"first")], timeout=5)
    second = await kv.txn(
        create_if_absent, [kv.txn_op_put(b"/smoke/t", b"second")], [kv.txn_op_get(b"/smoke/t")], timeout=5
    )
    assert first.succeeded and not second.succeeded
    assert second.responses[0].response_range.kvs[0].value == b"first"
