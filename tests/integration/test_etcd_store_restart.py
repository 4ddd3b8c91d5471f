"""EtcdStore against one etcd that crashes and comes back: the watch resumes exactly."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge_services.common.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer

pytestmark = pytest.mark.etcd


async def test_watch_resumes_after_etcd_restart(etcd_server: EtcdServer) -> None:
    store = EtcdStore([etcd_server.endpoint], timeout=5.0)
    try:
        rev = await store.put(b"/rs/a", b"1")
        watch = store.watch_prefix(b"/rs/", start_revision=rev)
        assert [e.kv.key for e in (await anext(watch)).events] == [b"/rs/a"]
        etcd_server.kill()
        etcd_server.restart()
        rev_b = await store.put(b"/rs/b", b"2")
        async with asyncio.timeout(15):
            batch = await anext(watch)
        assert [(e.kv.key, e.kv.mod_revision) for e in batch.events] == [(b"/rs/b", rev_b)]
        await watch.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()
