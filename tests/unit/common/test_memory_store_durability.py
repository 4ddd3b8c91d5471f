"""MemoryStore with a data_dir: acknowledged writes survive a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_services.common.store import Compacted, Delete, LeaseNotFound, Put
from kvbridge_services.common.store.memory import MemoryStore


async def test_restart_recovers_acknowledged_writes_and_leases(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await store.put(b"/d/a", b"1")
    await store.put(b"/d/a", b"2")
    lease = await store.grant_lease(60)
    await store.txn([], [Put(b"/d/leased", b"x", lease=lease), Put(b"/d/b", b"3"), Delete(b"/d/gone")])
    await store.delete(b"/d/b")
    revision = await store.current_revision()
    await store.close()

    reopened = MemoryStore(data_dir=tmp_path)
    try:
        assert await reopened.current_revision() == revision
        a = await reopened.get(b"/d/a")
        assert a is not None and (a.value, a.version) == (b"2", 2)
        assert await reopened.get(b"/d/b") is None
        assert 0 < await reopened.lease_ttl(lease) <= 60
        await reopened.revoke_lease(lease)  # attached keys were re-linked to the lease
        assert await reopened.get(b"/d/leased") is None
        with pytest.raises(Compacted):  # history before the restart is gone
            await anext(reopened.watch_prefix(b"/d/", start_revision=2))
    finally:
        await reopened.close()


async def test_torn_tail_is_dropped(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await store.put(b"/d/ok", b"1")
    await store.close()
    with (tmp_path / "log").open("ab") as log:
        log.write(b"\x40\x00\x00\x00garbage")  # a record cut short by a crash
    reopened = MemoryStore(data_dir=tmp_path)
    try:
        assert (await reopened.get(b"/d/ok")) is not None
        await reopened.put(b"/d/after", b"2")
    finally:
        await reopened.close()
    again = MemoryStore(data_dir=tmp_path)
    try:
        assert (await again.get(b"/d/after")) is not None
    finally:
        await again.close()


async def test_snapshot_bounds_the_log_and_recovers(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path, max_log_bytes=2048)
    for i in range(200):
        await store.put(f"/d/k{i % 20}".encode(), f"value-{i}".encode())
    revision = await store.current_revision()
    await store.close()
    assert (tmp_path / "snapshot").exists()
    assert (tmp_path / "log").stat().st_size <= 2048 + 512
    reopened = MemoryStore(data_dir=tmp_path)
    try:
        assert await reopened.current_revision() == revision
        kvs, _ = await reopened.range_prefix(b"/d/")
        assert len(kvs) == 20
        k19 = await reopened.get(b"/d/k19")
        assert k19 is not None and (k19.value, k19.version) == (b"value-199", 10)
    finally:
        await reopened.close()


async def test_bounded_history_compacts(tmp_path: Path) -> None:
    store = MemoryStore(history_revisions=3)
    first = await store.put(b"/h/a", b"0")
    for i in range(5):
        await store.put(b"/h/a", str(i).encode())
    with pytest.raises(Compacted) as info:
        await anext(store.watch_prefix(b"/h/", start_revision=first))
    assert info.value.compact_revision == await store.current_revision() - 2
    with pytest.raises(LeaseNotFound):
        await store.put(b"/h/b", b"x", lease=12345)
    await store.close()
