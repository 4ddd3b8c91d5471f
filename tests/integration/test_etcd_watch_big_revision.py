"""A revision larger than one gRPC message reaches the watcher (real etcd).

An etcd lease's expiry or revocation deletes every key attached to it in one revision, and the store's watch asks
for each delete's previous value: the registry's idempotency records (the size of an entry, attached to one lease
per window) made a 4.4 MiB revision at 100 turns/s with a 30 s window (bench/etcd_space.py), past gRPC's 4 MiB
receive limit. The watch failed with RESOURCE_EXHAUSTED at that revision on every retry, and the registry's index
stayed stale until etcd compacted the revision away. The store asks etcd to fragment such a revision and puts it
back together.
"""

from __future__ import annotations

import asyncio

import pytest

from kvbridge_services.common.store.base import EventType, Put
from kvbridge_services.common.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer

pytestmark = [pytest.mark.etcd]

KEYS = 1_500
VALUE = b"v" * 4096  # 1,500 x 4 KiB of previous values: ~6 MiB in one revision
BATCH = 100  # under etcd's 128 ops and 1.5 MiB per txn


@pytest.mark.parametrize("prev_kv", [True, False])
async def test_a_revision_larger_than_a_grpc_message_reaches_the_watcher(
    etcd_server: EtcdServer, prev_kv: bool
) -> None:
    """With previous values (~6 MiB, fragmented) and without them (the registry's index feeder: keys only)."""
    store = EtcdStore([etcd_server.endpoint], timeout=10.0)
    try:
        lease = await store.grant_lease(600)
        for start in range(0, KEYS, BATCH):
            await store.txn(
                [], [Put(f"/big/{i:05d}".encode(), VALUE, lease=lease) for i in range(start, start + BATCH)]
            )
        after = await store.current_revision()
        watch = store.watch_prefix(b"/big/", start_revision=after + 1, prev_kv=prev_kv)
        await store.revoke_lease(lease)  # every key deleted in one revision
        deleted: list[bytes] = []
        revisions: set[int] = set()
        async with asyncio.timeout(30):
            async for batch in watch:
                for event in batch.events:
                    assert event.type is EventType.DELETE
                    if prev_kv:
                        assert event.prev_kv is not None and event.prev_kv.value == VALUE
                    else:
                        assert event.prev_kv is None
                    deleted.append(event.kv.key)
                    revisions.add(event.kv.mod_revision)
                if len(deleted) >= KEYS:
                    break
        await watch.aclose()  # type: ignore[attr-defined]
        assert sorted(deleted) == [f"/big/{i:05d}".encode() for i in range(KEYS)]
        assert len(revisions) == 1
    finally:
        await store.close()
