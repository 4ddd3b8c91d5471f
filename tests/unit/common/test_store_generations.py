"""Store generations (ADR 0024): a rolled-back store opens as a new generation and retires the older one's soft
state (entries, idempotency records, close tombstones, every lease but node leases); engines, node leases and
everything else are kept. A copy of the directory, a repair that cut acknowledged records and ``kvbridge store
new-generation`` start one; a plain reopen and a torn final record do not."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kvbridge.lease.v1 import lease_pb2
from kvbridge_services.cli import main as kvbridge
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.generation import retire_soft_state
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.store.wal import _HEADER, LOG_NAME, StoreLocked, read_generation, repair
from tests.fixtures.etcd import EtcdServer

K = KeyLayout()
NODE = lease_pb2.Lease(lease_id=1, kind=lease_pb2.LEASE_KIND_NODE, engine_id="d0").SerializeToString()
ENTRY = lease_pb2.Lease(lease_id=2, kind=lease_pb2.LEASE_KIND_ENTRY, engine_id="d0", tenant="acme").SerializeToString()
SOFT = {K.entry("acme", "m", "c1"), K.registry_request("r1"), K.closed("acme", "m", "c2"), K.lease(2)}
HARD = {K.engine("d0"), K.lease(1), K.leader("lease"), b"/other/key"}


async def _fill(store: MemoryStore) -> None:
    for key in SOFT | HARD:
        value = NODE if key == K.lease(1) else ENTRY if key == K.lease(2) else b"x"
        await store.put(key, value)


async def _reopen(directory: Path) -> tuple[set[bytes], int, str]:
    store = MemoryStore(data_dir=directory)
    try:
        return set(store._kvs), store.retired, store.generation
    finally:
        await store.close()


async def test_a_reopened_store_keeps_its_generation_and_everything(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await _fill(store)
    generation = store.generation
    await store.close()
    assert generation
    assert await _reopen(tmp_path) == (SOFT | HARD, 0, generation)


async def test_a_copy_of_the_directory_opens_as_a_new_generation(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = MemoryStore(data_dir=data)
    await _fill(store)
    generation = store.generation
    await store.close()
    shutil.copytree(data, tmp_path / "backup")
    shutil.rmtree(data)
    shutil.copytree(tmp_path / "backup", data)
    keys, retired, new = await _reopen(data)
    assert (keys, retired) == (HARD, len(SOFT)) and new != generation
    assert (read_generation(data) or {})["previous"] == generation
    assert await _reopen(data) == (HARD, 0, new)  # the new generation's own file from now on


async def test_a_repair_that_dropped_acknowledged_records_starts_a_new_generation(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await _fill(store)
    offset = (tmp_path / LOG_NAME).stat().st_size
    await store.put(b"/other/late", b"y")
    await store.put(b"/other/later", b"z")
    await store.close()
    raw = bytearray((tmp_path / LOG_NAME).read_bytes())
    raw[offset + _HEADER.size + 3] ^= 1
    (tmp_path / LOG_NAME).write_bytes(bytes(raw))
    assert repair(tmp_path).damage is not None
    keys, retired, _ = await _reopen(tmp_path)
    assert (keys, retired) == (HARD, len(SOFT))


async def test_a_torn_final_record_is_no_new_generation(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await _fill(store)
    generation = store.generation
    await store.close()
    with (tmp_path / LOG_NAME).open("ab") as f:
        f.write(b"\x30\x00\x00\x00torn")
    assert await _reopen(tmp_path) == (SOFT | HARD, 0, generation)


async def test_new_generation_marks_the_directory_and_is_refused_while_open(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await _fill(store)
    with pytest.raises(StoreLocked):
        MemoryStore(data_dir=tmp_path)
    assert kvbridge(["store", "new-generation", "--data-dir", str(tmp_path)]) == 1  # in use
    await store.close()
    assert kvbridge(["store", "new-generation", "--data-dir", str(tmp_path)]) == 0
    keys, retired, _ = await _reopen(tmp_path)
    assert (keys, retired) == (HARD, len(SOFT))


async def test_retire_soft_state_on_any_store(tmp_path: Path) -> None:
    store = MemoryStore()
    try:
        await _fill(store)
        assert await retire_soft_state(store, b"/kvbridge/v1/") == len(SOFT)
        assert set(store._kvs) == HARD
    finally:
        await store.close()


@pytest.mark.etcd
async def test_new_generation_on_etcd_retires_in_place(etcd_server: EtcdServer) -> None:
    from kvbridge_services.common.store.etcd import EtcdStore

    store = EtcdStore([etcd_server.endpoint])
    try:
        for key in SOFT | {K.engine("d0"), K.lease(1)}:
            await store.put(key, NODE if key == K.lease(1) else ENTRY if key == K.lease(2) else b"x")
        assert await asyncio.to_thread(kvbridge, ["store", "new-generation", "--etcd", etcd_server.endpoint]) == 0
        left, _ = await store.range_prefix(b"/kvbridge/v1/")
        assert {kv.key for kv in left} == {K.engine("d0"), K.lease(1)}
    finally:
        await store.close()


async def test_an_older_copy_written_over_the_same_files_is_a_new_generation(tmp_path: Path) -> None:
    """The log keeps its inode (the copy is written over it, as an inode reused by ``rm -r`` then ``cp -r`` would
    look): the high-water mark kept beside the directory says acknowledged records are missing."""
    data = tmp_path / "data"
    store = MemoryStore(data_dir=data)
    await _fill(store)
    await store.close()
    shutil.copytree(data, tmp_path / "backup")
    store = MemoryStore(data_dir=data)
    await store.put(b"/other/late", b"y")
    await store.close()
    for name in ("log", "generation"):
        shutil.copyfile(tmp_path / "backup" / name, data / name)  # same files, older contents
    keys, retired, _ = await _reopen(data)
    assert (keys, retired) == (HARD, len(SOFT))
    assert await _reopen(data) == (HARD, 0, _reopen_generation(data))


def _reopen_generation(directory: Path) -> str:
    return str((read_generation(directory) or {}).get("id", ""))
