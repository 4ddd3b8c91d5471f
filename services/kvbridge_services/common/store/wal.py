"""Durability for the embedded store: a snapshot file plus an append-only log.

Each commit is one log record: ``[u32 length][u32 crc32][payload]``, fsynced
before the commit is acknowledged. When the log passes ``max_log_bytes`` the
full state is written to ``snapshot`` (tmp + fsync + rename + directory fsync)
and the log restarts empty; records carry a sequence number so a crash between
those two steps replays nothing twice.

Damage is told apart from a crash (ADR 0012):

- a bad record with no valid record after it is a torn *final* write (a crash
  mid-append, never acknowledged): it is cut on open and the cut is logged
  (WARNING: file, offset, bytes);
- a bad record followed by valid ones is damage to acknowledged data: the
  store refuses to open (``StoreDamaged`` naming the file, the offset and
  ``kvbridge store repair``) instead of silently dropping what follows;
- the snapshot carries a header with its length and crc32; a truncated or
  altered snapshot is refused. A snapshot written before that header existed
  (plain JSON) is still read, and rewritten with the header on open.

A failed append or snapshot makes the log fail-stop: every later append is
refused (the on-disk state after a failed write or fsync is unknown).

Payloads are JSON with bytes carried as latin-1 strings (lossless, stdlib only).
The scan and repair functions are pure over the file's bytes (``scan_log``).

Generations (ADR 0024): the file ``generation`` names the store's generation and the log file it was written
for (its inode number). Opening a directory whose log is not that file (a copy or a restored backup), whose
record says it was repaired (``kvbridge store repair`` cut acknowledged records, or ``kvbridge store
new-generation``), or that has no record although it holds data, starts a new generation: the store retires
the older generation's soft state (``MemoryStore``) and the record is rewritten for the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import struct
import time
import zlib
from dataclasses import dataclass, field
from io import BufferedWriter
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
DEFAULT_MAX_LOG_BYTES = 64 * 1024 * 1024
LOG_NAME = "log"
SNAPSHOT_NAME = "snapshot"
GENERATION_NAME = "generation"
_SNAPSHOT_HEADER = re.compile(rb"kvbridge-snapshot v2 length=(\d+) crc32=([0-9a-f]{8})\n")
REPAIR_HINT = "kvbridge store repair --data-dir {directory}"


class StoreOpenError(RuntimeError):
    """The embedded store's directory cannot be opened; the message says why and what to do."""


class StoreDamaged(StoreOpenError):
    """The log or snapshot is damaged in a way that opening would silently lose or alter acknowledged data."""


class StoreLocked(StoreOpenError):
    """Another process (or another store in this process) has the directory open."""


class LogFailed(OSError):
    """An append or snapshot failed earlier: the log refuses every later write (fail-stop)."""


def b2s(data: bytes) -> str:
    return data.decode("latin-1")


def s2b(text: str) -> bytes:
    return text.encode("latin-1")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- scanning (pure)


@dataclass(frozen=True, slots=True)
class Damage:
    offset: int  # where the first bad record starts: everything from here on is in question
    reason: str
    bytes_after: int  # bytes from ``offset`` to the end of the file
    valid_after: int  # valid records found after the damage (acknowledged data a cut would drop)
    seq_after: tuple[int, int] | None  # first and last seq of those records

    @property
    def torn_tail(self) -> bool:
        """Nothing valid follows: a write cut short by a crash (never acknowledged)."""
        return self.valid_after == 0


@dataclass(frozen=True, slots=True)
class LogScan:
    records: list[dict[str, Any]] = field(default_factory=list)  # the valid records before any damage
    end: int = 0  # offset just after the last of them
    damage: Damage | None = None


def _record_at(data: bytes, offset: int) -> tuple[dict[str, Any] | None, int, str]:
    """The record starting at ``offset`` (or None), the offset after it, and why it is bad."""
    if offset + _HEADER.size > len(data):
        return None, offset, f"incomplete record header ({len(data) - offset} of {_HEADER.size} bytes)"
    length, crc = _HEADER.unpack_from(data, offset)
    start = offset + _HEADER.size
    if length == 0:
        return None, offset, "zero-length record"
    if start + length > len(data):
        return None, offset, f"record of {length} bytes runs past the end of the file"
    payload = data[start : start + length]
    if zlib.crc32(payload) != crc:
        return None, offset, "checksum mismatch"
    try:
        record = json.loads(payload)
    except ValueError:
        return None, offset, "checksum matches but the payload is not JSON"
    if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
        return None, offset, "record without a sequence number"
    return record, start + length, ""


def _valid_records_after(data: bytes, offset: int) -> list[dict[str, Any]]:
    """Valid records that start after ``offset``: re-synchronize on candidate payload starts (every
    payload is a JSON object, ``{"``) and keep those whose length and crc32 match."""
    found: list[dict[str, Any]] = []
    pos = offset + 1
    while True:
        candidate = data.find(b'{"', pos + _HEADER.size)
        if candidate < 0:
            return found
        header = candidate - _HEADER.size
        record, after, _ = _record_at(data, header)
        if record is None:
            pos = header + 1
            continue
        found.append(record)
        # Read on record by record from here; re-synchronize again past any further damage.
        while True:
            record, next_after, _ = _record_at(data, after)
            if record is None:
                break
            found.append(record)
            after = next_after
        if after >= len(data):
            return found
        pos = after


def scan_log(data: bytes) -> LogScan:
    """Valid records up to the first damage, and what the damage is (see the module docstring)."""
    records: list[dict[str, Any]] = []
    offset = 0
    reason = ""
    while offset < len(data):
        record, after, reason = _record_at(data, offset)
        if record is None:
            break
        if records and record["seq"] != records[-1]["seq"] + 1:
            reason = f"record seq {record['seq']} follows seq {records[-1]['seq']} (records missing)"
            break
        records.append(record)
        offset = after
    if offset >= len(data):
        return LogScan(records, offset)
    following = _valid_records_after(data, offset)
    gap_record = _record_at(data, offset)[0]  # a valid record after a gap in the sequence counts too
    if gap_record is not None:
        following.insert(0, gap_record)
    seq_after = (int(following[0]["seq"]), int(following[-1]["seq"])) if following else None
    return LogScan(records, offset, Damage(offset, reason, len(data) - offset, len(following), seq_after))


def damage_message(path: Path, damage: Damage) -> str:
    seqs = f" (seq {damage.seq_after[0]}..{damage.seq_after[1]})" if damage.seq_after else ""
    return (
        f"embedded store log {path} is damaged at offset {damage.offset} ({damage.reason}); "
        f"{damage.valid_after} valid records{seqs} follow it, so it is not a torn final write. "
        f"Refusing to open rather than drop acknowledged data. To keep the records before offset "
        f"{damage.offset} and drop the {damage.bytes_after} bytes from there on, stop every process using the "
        f"directory and run: {REPAIR_HINT.format(directory=path.parent)} (or restore the directory from a backup)"
    )


# --------------------------------------------------------------------------- snapshot format


def encode_snapshot(state: dict[str, Any]) -> bytes:
    payload = json.dumps(state, separators=(",", ":")).encode()
    return b"kvbridge-snapshot v2 length=%d crc32=%08x\n" % (len(payload), zlib.crc32(payload)) + payload


def decode_snapshot(path: Path, data: bytes) -> tuple[dict[str, Any], bool]:
    """The snapshot's state and whether it is the old header-less format; ``StoreDamaged`` if it is not intact."""

    def damaged(why: str) -> StoreDamaged:
        return StoreDamaged(
            f"embedded store snapshot {path} is damaged ({why}); refusing to open rather than serve altered or "
            f"partial state. Restore the directory from a backup (the log holds only the writes after the snapshot)"
        )

    legacy = data[:1] == b"{"
    if legacy:
        payload = data
    else:
        match = _SNAPSHOT_HEADER.match(data)
        if match is None:
            raise damaged("no valid snapshot header")
        payload = data[match.end() :]
        if len(payload) != int(match[1]):
            raise damaged(f"{len(payload)} bytes where the header says {int(match[1])}: truncated or extended")
        if f"{zlib.crc32(payload):08x}".encode() != match[2]:
            raise damaged("checksum mismatch")
    try:
        state = json.loads(payload)
    except ValueError as exc:
        raise damaged(f"not valid JSON: {exc}") from None
    if not isinstance(state, dict) or not all(k in state for k in ("seq", "rev", "kvs", "leases")):
        raise damaged("missing fields")
    return state, legacy


# --------------------------------------------------------------------------- the log


class WriteAheadLog:
    """Not coroutine-aware: the store serializes calls and runs them in a thread.

    Opening takes an exclusive lock on the log (one process per directory) and may raise
    ``StoreOpenError``; ``load`` may raise ``StoreDamaged``.
    """

    def __init__(self, directory: Path, *, max_log_bytes: int = DEFAULT_MAX_LOG_BYTES) -> None:
        self.directory = directory
        self.max_log_bytes = max_log_bytes
        self._log_path = directory / LOG_NAME
        self._snapshot_path = directory / SNAPSHOT_NAME
        self._log, self._created = _open_locked(directory, self._log_path)
        self.next_seq = 1
        self.failed: BaseException | None = None
        self.legacy_snapshot = False
        # The generation this directory holds, and why opening it starts a new one ("": it does not).
        self.generation = ""
        self.rollback = ""
        # The highest seq this store acknowledged, kept beside the directory (not in it, so a backup of the
        # directory put back cannot bring an older one with it): a log ending below it was rolled back.
        self._hwm_path = directory.parent / f".{directory.name}.kvbridge-seq"
        self._hwm_fd: int | None = None

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The last snapshot (or None) and the log records after it, in order."""
        snapshot: dict[str, Any] | None = None
        if self._snapshot_path.exists():
            snapshot, self.legacy_snapshot = decode_snapshot(self._snapshot_path, self._snapshot_path.read_bytes())
        after = int(snapshot["seq"]) if snapshot else 0
        scan = scan_log(self._log_path.read_bytes())
        if scan.damage is not None:
            if not scan.damage.torn_tail:
                raise StoreDamaged(damage_message(self._log_path, scan.damage))
            log.warning(
                "embedded store log %s: cut a torn final record at offset %d (%d bytes: %s); it was never acknowledged",
                self._log_path,
                scan.damage.offset,
                scan.damage.bytes_after,
                scan.damage.reason,
            )
            self._truncate(scan.damage.offset)
        records = [r for r in scan.records if int(r["seq"]) > after]
        if records and int(records[0]["seq"]) != after + 1:
            raise StoreDamaged(
                f"embedded store log {self._log_path} starts at seq {records[0]['seq']} but the snapshot ends at "
                f"seq {after}: records are missing. Restore the directory from a backup"
            )
        self.next_seq = int(records[-1]["seq"]) + 1 if records else after + 1
        self._open_high_water()
        self.rollback = self._check_generation(empty=snapshot is None and not records)
        if not self.rollback:  # else kept until the older generation is retired (begin_generation)
            self._note_seq(self.next_seq - 1)
        return snapshot, records

    def _read_high_water(self) -> int:
        try:
            return int(self._hwm_path.read_bytes().strip() or b"0")
        except (OSError, ValueError):
            return 0

    def _open_high_water(self) -> None:
        try:
            self._hwm_fd = os.open(self._hwm_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning(
                "embedded store %s: cannot keep its high-water mark in %s (%s): a backup of the directory put back "
                "over it is detected only by the log file's identity (docs/adr/0024)",
                self.directory,
                self._hwm_path,
                exc,
            )

    def _note_seq(self, seq: int) -> None:
        """After a durable append: not fsynced itself (after a power loss it may lag the log, never lead it)."""
        if self._hwm_fd is not None:
            with contextlib.suppress(OSError):
                os.pwrite(self._hwm_fd, b"%020d\n" % seq, 0)

    def _identity(self) -> list[int]:
        """The log file's identity: its inode number. A copy is another file; the device number is left out, as
        some filesystems (overlay, network mounts) give the same files another one after a remount."""
        return [os.fstat(self._log.fileno()).st_ino]

    def _check_generation(self, *, empty: bool) -> str:
        """Why this open starts a new generation ("" when it continues the recorded one)."""
        record = read_generation(self.directory)
        if record is None:
            if self._created or empty:
                self.begin_generation("")  # a new store: its first generation
                return ""
            return "no generation record: a store written before generations, or files copied without it"
        self.generation = str(record.get("id", ""))
        if record.get("retire"):
            return str(record["retire"])
        acknowledged, last = self._read_high_water(), self.next_seq - 1
        if acknowledged > last:
            return (
                f"its log ends at seq {last} but this store acknowledged up to seq {acknowledged} "
                f"({self._hwm_path}): an older copy of the directory was put back, or records were cut"
            )
        if record.get("log") != self._identity():
            return (
                "its log is not the file this store wrote (the directory was copied or restored from a backup; "
                f"recorded file {record.get('log')}, found {self._identity()})"
            )
        return ""

    def begin_generation(self, reason: str) -> str:
        """Record a new generation for this log file (after the older one's soft state was retired)."""
        previous = self.generation
        self.generation = secrets.token_hex(8)
        _write_generation(
            self.directory,
            {
                "id": self.generation,
                "log": self._identity(),
                "previous": previous,
                "reason": reason,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        self.rollback = ""
        self._note_seq(self.next_seq - 1)
        return self.generation

    def _truncate(self, offset: int) -> None:
        self._log.truncate(offset)
        self._log.seek(offset)
        self._log.flush()
        os.fsync(self._log.fileno())

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one record (assigns its ``seq``); after a failure every later call raises ``LogFailed``."""
        if self.failed is not None:
            raise LogFailed(f"the log refuses writes after an earlier failure: {self.failed}")
        record["seq"] = self.next_seq
        payload = json.dumps(record, separators=(",", ":")).encode()
        try:
            self._log.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
            self._log.flush()
            os.fsync(self._log.fileno())
        except BaseException as exc:
            self.failed = exc
            raise
        self.next_seq += 1
        self._note_seq(record["seq"])

    def needs_snapshot(self) -> bool:
        return self._log.tell() > self.max_log_bytes

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Persist the full state as of the last appended record, then empty the log (fail-stop on error)."""
        if self.failed is not None:
            raise LogFailed(f"the log refuses writes after an earlier failure: {self.failed}")
        state["seq"] = self.next_seq - 1
        tmp = self.directory / (SNAPSHOT_NAME + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(encode_snapshot(state))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._snapshot_path)
            _fsync_dir(self.directory)
            self._truncate(0)
        except BaseException as exc:
            self.failed = exc
            raise
        self.legacy_snapshot = False

    def close(self) -> None:
        if self._hwm_fd is not None:
            os.close(self._hwm_fd)
            self._hwm_fd = None
        self._log.close()


def read_generation(directory: Path) -> dict[str, Any] | None:
    """The directory's generation record (None: none; an unreadable one reads as a retired generation)."""
    path = directory / GENERATION_NAME
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
        if isinstance(record, dict):
            return record
    except ValueError:
        pass
    return {"retire": f"unreadable generation record {path}"}


def _write_generation(directory: Path, record: dict[str, Any]) -> None:
    tmp = directory / (GENERATION_NAME + ".tmp")
    with tmp.open("wb") as f:
        f.write(json.dumps(record, separators=(",", ":")).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / GENERATION_NAME)
    _fsync_dir(directory)


def retire_generation(directory: Path, reason: str) -> None:
    """Mark the directory's generation as ended: the next open starts a new one (ADR 0024)."""
    record = read_generation(directory) or {}
    record["retire"] = reason
    _write_generation(directory, record)


def _open_locked(directory: Path, log_path: Path) -> tuple[BufferedWriter, bool]:
    """The log opened for appending, exclusively locked, and whether it was created now; a new directory or log
    file is made durable."""
    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True)
        _fsync_dir(directory.parent)
    created = not log_path.exists()
    f = log_path.open("ab")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StoreLocked(
            f"embedded store directory {directory} is in use by another process (its log is locked)"
        ) from None
    if created:
        os.fsync(f.fileno())
        _fsync_dir(directory)
    return f, created


# --------------------------------------------------------------------------- operator tools


@dataclass(frozen=True, slots=True)
class VerifyReport:
    directory: Path
    log_bytes: int
    log_records: int
    snapshot: str  # "none" | "ok" | "ok (old format, no checksum)" | the damage message
    snapshot_ok: bool
    damage: Damage | None

    @property
    def ok(self) -> bool:
        return self.snapshot_ok and self.damage is None


def verify(directory: Path) -> VerifyReport:
    """Check the snapshot and the log without changing anything (the directory may be in use)."""
    snapshot_path = directory / SNAPSHOT_NAME
    snapshot, snapshot_ok = "none", True
    if snapshot_path.exists():
        try:
            _, legacy = decode_snapshot(snapshot_path, snapshot_path.read_bytes())
            snapshot = "ok (old format, no checksum)" if legacy else "ok"
        except StoreDamaged as exc:
            snapshot, snapshot_ok = str(exc), False
    log_path = directory / LOG_NAME
    data = log_path.read_bytes() if log_path.exists() else b""
    scan = scan_log(data)
    return VerifyReport(directory, len(data), len(scan.records), snapshot, snapshot_ok, scan.damage)


@dataclass(frozen=True, slots=True)
class RepairReport:
    kept_records: int
    damage: Damage | None  # None: nothing to repair


def repair(directory: Path) -> RepairReport:
    """Truncate the log at its first damage (dropping everything from there on) and say what was dropped.

    Takes the directory's lock, so it refuses while a store has the directory open. A damaged snapshot is
    not repaired here (``verify`` reports it).
    """
    log_path = directory / LOG_NAME
    if not log_path.exists():
        raise StoreOpenError(f"no embedded store log at {log_path}")
    f, _ = _open_locked(directory, log_path)
    try:
        scan = scan_log(log_path.read_bytes())
        if scan.damage is not None:
            if not scan.damage.torn_tail:
                # Acknowledged records are dropped: the store is rolled back, its next open a new generation.
                retire_generation(
                    directory, f"repaired: the log was cut at offset {scan.damage.offset} ({scan.damage.reason})"
                )
            f.truncate(scan.damage.offset)
            f.flush()
            os.fsync(f.fileno())
            log.warning(
                "embedded store log %s: repair cut %d bytes at offset %d (%d valid records dropped)",
                log_path,
                scan.damage.bytes_after,
                scan.damage.offset,
                scan.damage.valid_after,
            )
        return RepairReport(len(scan.records), scan.damage)
    finally:
        with contextlib.suppress(OSError):
            f.close()
