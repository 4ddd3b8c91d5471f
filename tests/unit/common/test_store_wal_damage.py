"""The embedded store's files under damage: a torn final record is cut (and logged), damage followed by valid
records refuses to open and names the offset and the repair, snapshots are checksummed, a failed append is
fail-stop. The store is opened from disk exactly as the services open it (``MemoryStore(data_dir=...)``)."""

from __future__ import annotations

import json
import logging
import os
import stat
import zlib
from pathlib import Path

import pytest

from kvbridge_services.common.store import StoreUnavailable
from kvbridge_services.common.store import wal as wal_mod
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.store.wal import (
    StoreDamaged,
    StoreLocked,
    encode_snapshot,
    repair,
    scan_log,
    verify,
)

WAL_FSYNC = "kvbridge_services.common.store.wal.os.fsync"  # the fsync the write-ahead log calls

N = 20


async def _write(directory: Path, n: int = N, **kw: int) -> list[int]:
    """``n`` acknowledged puts; the log offset where each record starts."""
    store = MemoryStore(data_dir=directory, **kw)
    offsets = []
    for i in range(n):
        offsets.append((directory / "log").stat().st_size)
        await store.put(f"/k/{i:03d}".encode(), f"value-{i}".encode())
    await store.close()
    return offsets


async def _keys(directory: Path) -> list[bytes]:
    store = MemoryStore(data_dir=directory)
    try:
        kvs, _ = await store.range_prefix(b"/k/")
        return [kv.key for kv in kvs]
    finally:
        await store.close()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload", "length field", "checksum field"])
async def test_a_bit_flipped_mid_log_refuses_to_open_and_names_offset_and_repair(tmp_path: Path, where: str) -> None:
    offsets = await _write(tmp_path)
    bad = offsets[7]
    _flip(tmp_path / "log", bad + {"payload": 20, "length field": 2, "checksum field": 5}[where])
    before = (tmp_path / "log").read_bytes()
    with pytest.raises(StoreDamaged) as info:
        MemoryStore(data_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path / "log") in message
    assert f"offset {bad} " in message
    assert f"kvbridge store repair --data-dir {tmp_path}" in message
    assert f"{N - 8} valid records (seq 9..{N})" in message
    assert (tmp_path / "log").read_bytes() == before  # nothing cut by opening


async def test_a_zeroed_block_mid_log_is_damage_not_a_tail(tmp_path: Path) -> None:
    offsets = await _write(tmp_path)
    data = bytearray((tmp_path / "log").read_bytes())
    data[offsets[3] : offsets[5]] = bytes(offsets[5] - offsets[3])
    (tmp_path / "log").write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match=f"offset {offsets[3]} .*zero-length record"):
        MemoryStore(data_dir=tmp_path)


@pytest.mark.parametrize("cut", [3, 8 + 5])  # inside the header; inside the payload
async def test_a_torn_final_record_is_cut_and_logged_and_nothing_acknowledged_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    await _write(tmp_path)
    log_path = tmp_path / "log"
    end = log_path.stat().st_size
    store = MemoryStore(data_dir=tmp_path)
    await store.put(b"/k/unacknowledged", b"x" * 100)
    await store.close()
    with log_path.open("r+b") as f:  # the crash: only ``cut`` bytes of the last record reached the disk
        f.truncate(end + cut)
    with caplog.at_level(logging.WARNING, logger="kvbridge_services.common.store.wal"):
        keys = await _keys(tmp_path)
    assert keys == [f"/k/{i:03d}".encode() for i in range(N)]
    # (The cut record was acknowledged here, so the store also starts a new generation, ADR 0024: a real torn
    # write never was.)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == wal_mod.__name__]
    assert f"at offset {end} ({cut} bytes" in warning.getMessage() and str(log_path) in warning.getMessage()
    assert log_path.stat().st_size == end
    assert await _keys(tmp_path) == keys  # and the next open finds a clean log


async def test_repair_cuts_at_the_damage_and_reports_what_it_dropped(tmp_path: Path) -> None:
    offsets = await _write(tmp_path)
    _flip(tmp_path / "log", offsets[12] + 15)
    assert not verify(tmp_path).ok
    report = repair(tmp_path)
    assert report.kept_records == 12
    assert report.damage is not None and report.damage.offset == offsets[12]
    assert (report.damage.valid_after, report.damage.seq_after) == (N - 13, (14, N))
    assert verify(tmp_path).ok
    assert await _keys(tmp_path) == [f"/k/{i:03d}".encode() for i in range(12)]
    assert repair(tmp_path).damage is None


async def test_repair_refuses_while_a_store_has_the_directory_open(tmp_path: Path) -> None:
    await _write(tmp_path, 2)
    store = MemoryStore(data_dir=tmp_path)
    try:
        with pytest.raises(StoreLocked):
            repair(tmp_path)
        with pytest.raises(StoreLocked, match="in use"):
            MemoryStore(data_dir=tmp_path)
    finally:
        await store.close()


async def _with_snapshot(directory: Path) -> None:
    await _write(directory, 60, max_log_bytes=1024)
    assert (directory / "snapshot").read_bytes().startswith(b"kvbridge-snapshot v2 ")


async def test_a_truncated_snapshot_is_refused(tmp_path: Path) -> None:
    await _with_snapshot(tmp_path)
    snap = tmp_path / "snapshot"
    snap.write_bytes(snap.read_bytes()[:-40])
    with pytest.raises(StoreDamaged, match=r"snapshot .* is damaged .*truncated"):
        MemoryStore(data_dir=tmp_path)
    assert not verify(tmp_path).ok


async def test_one_changed_character_in_the_snapshot_is_refused_never_served(tmp_path: Path) -> None:
    await _with_snapshot(tmp_path)
    snap = tmp_path / "snapshot"
    data = snap.read_bytes()
    assert b"value-3" in data
    snap.write_bytes(data.replace(b"value-3", b"value-4", 1))
    with pytest.raises(StoreDamaged, match="checksum mismatch"):
        MemoryStore(data_dir=tmp_path)


async def test_a_snapshot_in_the_old_format_is_read_and_rewritten_with_a_checksum(tmp_path: Path) -> None:
    await _with_snapshot(tmp_path)
    snap = tmp_path / "snapshot"
    state = json.loads(snap.read_bytes().split(b"\n", 1)[1])
    snap.write_bytes(json.dumps(state).encode())  # as written before the header existed
    keys = await _keys(tmp_path)
    assert keys == [f"/k/{i:03d}".encode() for i in range(60)]
    assert snap.read_bytes().startswith(b"kvbridge-snapshot v2 ")
    assert await _keys(tmp_path) == keys


async def test_a_failed_append_is_fail_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(data_dir=tmp_path)
    await store.put(b"/k/ok", b"1")
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(WAL_FSYNC, failing_fsync)
    with pytest.raises(StoreUnavailable, match="refuses every write"):
        await store.put(b"/k/failed", b"2")
    monkeypatch.setattr(WAL_FSYNC, real_fsync)  # the disk "recovers": writes stay refused
    assert await store.get(b"/k/failed") is None  # never applied, never acknowledged
    with pytest.raises(StoreUnavailable, match="refuses every write"):
        await store.put(b"/k/later", b"3")
    with pytest.raises(StoreUnavailable):
        await store.grant_lease(10)
    assert (await store.get(b"/k/ok")) is not None  # reads still answer
    await store.close()
    reopened = MemoryStore(data_dir=tmp_path)  # the restart replays the log
    try:
        assert (await reopened.get(b"/k/ok")) is not None
        assert await reopened.get(b"/k/later") is None
    finally:
        await reopened.close()


async def test_the_directory_is_fsynced_when_the_log_is_created_and_the_snapshot_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced_dirs: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_dirs.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(WAL_FSYNC, recording_fsync)
    directory = tmp_path / "new" / "store"
    store = MemoryStore(data_dir=directory, max_log_bytes=256)
    assert directory.stat().st_ino in synced_dirs and (tmp_path / "new").stat().st_ino in synced_dirs
    synced_dirs.clear()
    for i in range(10):
        await store.put(f"/k/{i}".encode(), b"v" * 50)
    assert (directory / "snapshot").exists() and directory.stat().st_ino in synced_dirs
    await store.close()


def test_scan_tells_a_torn_tail_from_damage() -> None:
    records = [{"rev": i + 1, "m": [], "seq": i + 1} for i in range(5)]
    blobs = []
    for r in records:
        payload = json.dumps(r).encode()
        blobs.append(wal_mod._HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
    data = b"".join(blobs)
    assert scan_log(data).damage is None and len(scan_log(data).records) == 5
    torn = scan_log(data + blobs[0][:10])
    assert torn.damage is not None and torn.damage.torn_tail and torn.damage.offset == len(data)
    gap = scan_log(b"".join(blobs[:2] + blobs[3:]))  # a whole record missing
    assert gap.damage is not None and not gap.damage.torn_tail and "records missing" in gap.damage.reason
    assert encode_snapshot({"a": 1}).startswith(b"kvbridge-snapshot v2 length=7 crc32=")
