"""Durability for the embedded store: a snapshot file plus an append-only log.

Each commit is one log record: ``[u32 length][u32 crc32][payload]``, fsynced
before the commit is acknowledged. A torn or corrupt tail (a crash mid-write,
never acknowledged) is cut off on open. When the log passes ``max_log_bytes``
the full state is written to ``snapshot`` (tmp + fsync + rename) and the log
restarts empty; records carry a sequence number so a crash between those two
steps replays nothing twice.

Payloads are JSON with bytes carried as latin-1 strings (lossless, stdlib only).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<II")
DEFAULT_MAX_LOG_BYTES = 64 * 1024 * 1024


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


class WriteAheadLog:
    """Not coroutine-aware: the store serializes calls and runs them in a thread."""

    def __init__(self, directory: Path, *, max_log_bytes: int = DEFAULT_MAX_LOG_BYTES) -> None:
        self.directory = directory
        self.max_log_bytes = max_log_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._log_path = directory / "log"
        self._snapshot_path = directory / "snapshot"
        self._log = self._log_path.open("ab")
        self.next_seq = 1

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The last snapshot (or None) and the log records after it, in order."""
        snapshot: dict[str, Any] | None = None
        if self._snapshot_path.exists():
            snapshot = json.loads(self._snapshot_path.read_bytes())
        after = int(snapshot["seq"]) if snapshot else 0
        records = [r for r in self._read_log() if int(r["seq"]) > after]
        last = records[-1]["seq"] if records else after
        self.next_seq = int(last) + 1
        return snapshot, records

    def _read_log(self) -> Iterator[dict[str, Any]]:
        data = self._log_path.read_bytes()
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, offset)
            start = offset + _HEADER.size
            payload = data[start : start + length]
            if len(payload) < length or zlib.crc32(payload) != crc:
                break
            yield json.loads(payload)
            offset = start + length
        if offset < len(data):  # torn tail: never acknowledged, drop it
            self._log.truncate(offset)
            self._log.flush()
            os.fsync(self._log.fileno())

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one record (assigns its ``seq``)."""
        record["seq"] = self.next_seq
        payload = json.dumps(record, separators=(",", ":")).encode()
        self._log.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        self._log.flush()
        os.fsync(self._log.fileno())
        self.next_seq += 1

    def needs_snapshot(self) -> bool:
        return self._log.tell() > self.max_log_bytes

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Persist the full state as of the last appended record, then empty the log."""
        state["seq"] = self.next_seq - 1
        tmp = self.directory / "snapshot.tmp"
        with tmp.open("wb") as f:
            f.write(json.dumps(state, separators=(",", ":")).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snapshot_path)
        _fsync_dir(self.directory)
        self._log.truncate(0)
        self._log.seek(0)
        self._log.flush()
        os.fsync(self._log.fileno())

    def close(self) -> None:
        self._log.close()
