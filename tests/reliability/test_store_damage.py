"""Damaged files of the embedded store under a real lease-manager process (``--data-dir``, no etcd).

Acknowledged lease grants, kill -9, then the damage an operator may find on disk:
- one bit flipped mid-log: the process refuses to start (exit 1, no traceback) naming the file, the offset and
  ``kvbridge store repair``; the repair (run explicitly) cuts there and says what it dropped; the process then
  starts on a new generation of the store (ADR 0024): the leases the cut kept are of the rolled-back generation
  and are retired, none is served;
- a torn final record (a crash mid-append): the process starts, logs the cut (offset, bytes) and every
  acknowledged lease is there;
- a truncated or altered snapshot: refused at start with a clear message.
And the undamaged case: kill -9 under concurrent grants, twice; every acknowledged grant is there after each
restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.store.wal import _HEADER
from tests.fixtures.common import free_port
from tests.fixtures.control_plane_procs import _stop, _wait_for_grpc

pytestmark = [pytest.mark.slow]
GRANTS = 40


class EmbeddedLease:
    """``python -m kvbridge_services.lease --data-dir DIR`` on the embedded store, fixed port across restarts."""

    def __init__(self, data_dir: Path, log_dir: Path) -> None:
        self.data_dir, self.log_dir, self.port, self.starts = data_dir, log_dir, free_port(), 0
        self.env = {
            **os.environ,
            "KVBRIDGE_HOST": "127.0.0.1",
            "KVBRIDGE_LEASE_PORT": str(self.port),
            "KVBRIDGE_LEASE_METRICS_PORT": "0",
        }
        for var in ("KVBRIDGE_ETCD_ENDPOINTS", "KVBRIDGE_API_KEYS_FILE"):
            self.env.pop(var, None)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvbridge_services.lease", "--data-dir", str(self.data_dir)]

    @property
    def log(self) -> Path:
        return self.log_dir / f"lease-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        _wait_for_grpc(f"127.0.0.1:{self.port}", self.proc, self.log, timeout_s=60)

    def refused(self) -> tuple[int, str]:
        """Start, expecting it to exit on its own: exit code and output."""
        done = subprocess.run(self.command, env=self.env, capture_output=True, timeout=60, check=False)
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)


@pytest.fixture
def lease(tmp_path: Path) -> Iterator[EmbeddedLease]:
    proc = EmbeddedLease(tmp_path / "data", tmp_path)
    try:
        yield proc
    finally:
        proc.stop()


def _stub(lease: EmbeddedLease) -> tuple[grpc.Channel, lease_pb2_grpc.LeaseServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{lease.port}")
    return channel, lease_pb2_grpc.LeaseServiceStub(channel)


def _grant_all(lease: EmbeddedLease, n: int) -> list[int]:
    """``n`` acknowledged grants (retried until the lease manager is leader)."""
    channel, stub = _stub(lease)
    ids: list[int] = []
    try:
        for i in range(n):
            request = lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant="acme",
                engine_id="eng-1",
                model="m",
                conversation_key=f"c{i}",
                ttl=duration_pb2.Duration(seconds=600),
            )
            for _ in range(200):
                try:
                    ids.append(stub.GrantLease(request, timeout=5).lease.lease_id)
                    break
                except grpc.RpcError as err:
                    assert err.code() is grpc.StatusCode.UNAVAILABLE, err  # not leader yet
                    time.sleep(0.05)
            else:
                raise AssertionError("the lease manager never granted")
    finally:
        channel.close()
    return ids


def _listed(lease: EmbeddedLease) -> set[int]:
    channel, stub = _stub(lease)
    seen: set[int] = set()
    try:
        for _ in range(200):
            try:
                page = stub.ListLeases(lease_pb2.ListLeasesRequest(page_size=100), timeout=5)
                break
            except grpc.RpcError as err:
                assert err.code() is grpc.StatusCode.UNAVAILABLE, err
                time.sleep(0.05)
        seen.update(x.lease_id for x in page.leases)
        while page.next_page_token:
            page = stub.ListLeases(
                lease_pb2.ListLeasesRequest(page_size=100, page_token=page.next_page_token), timeout=5
            )
            seen.update(x.lease_id for x in page.leases)
    finally:
        channel.close()
    return seen


def _record_offsets(log: Path) -> list[int]:
    data, offsets, offset = log.read_bytes(), [], 0
    while offset + _HEADER.size <= len(data):
        offsets.append(offset)
        offset += _HEADER.size + _HEADER.unpack_from(data, offset)[0]
    return offsets


def _cli(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge_services.cli", *args], capture_output=True, timeout=60, check=False
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def test_a_bit_flipped_mid_log_refuses_to_start_until_repaired(lease: EmbeddedLease) -> None:
    lease.start()
    _grant_all(lease, GRANTS)
    lease.kill9()
    log = lease.data_dir / "log"
    offsets = _record_offsets(log)
    bad = offsets[len(offsets) // 2]
    data = bytearray(log.read_bytes())
    data[bad + _HEADER.size + 10] ^= 0x04
    log.write_bytes(bytes(data))

    code, output = lease.refused()
    print(f"refused start: exit {code}: {output.strip()}")
    assert code == 1
    assert "Traceback" not in output
    assert f"{log} is damaged at offset {bad} " in output
    assert f"kvbridge store repair --data-dir {lease.data_dir}" in output
    assert log.read_bytes() == bytes(data)  # the failed start cut nothing

    code, output = _cli("store", "verify", "--data-dir", str(lease.data_dir))
    assert code == 1 and f"log damage at offset {bad}" in output
    code, output = _cli("store", "repair", "--data-dir", str(lease.data_dir))
    print(f"repair: {output.strip()}")
    assert code == 0 and f"cut the log at offset {bad}" in output and "valid records (seq" in output
    assert _cli("store", "verify", "--data-dir", str(lease.data_dir))[0] == 0

    lease.start()
    # The repair rolled the store back: a new generation, whose open retired the leases the cut kept (those after
    # the damage are gone with it). Their holders take new ones (ADR 0024).
    assert _listed(lease) == set()
    started = lease.log.read_text()
    assert "starts a new generation" in started and f"repaired: the log was cut at offset {bad}" in started


def test_a_torn_final_record_is_cut_logged_and_nothing_acknowledged_is_lost(lease: EmbeddedLease) -> None:
    lease.start()
    granted = _grant_all(lease, GRANTS)
    lease.kill9()
    log = lease.data_dir / "log"
    data = log.read_bytes()
    end = len(data)
    last = _record_offsets(log)[-1]
    torn = data[last : last + 30]  # a record whose payload only partly reached the disk
    with log.open("ab") as f:
        f.write(torn)

    lease.start()
    assert _listed(lease) == set(granted)
    text = lease.log.read_text(errors="replace")
    cut = f"kvbridge_services.common.store.wal: embedded store log {log}: cut a torn final record at offset {end} "
    lines = [line for line in text.splitlines() if cut + f"({len(torn)} bytes" in line]
    assert len(lines) == 1 and " WARNING " in lines[0], text[-2000:]


@pytest.mark.parametrize("damage", ["truncated", "one character changed"])
def test_a_damaged_snapshot_is_refused_at_start(lease: EmbeddedLease, damage: str) -> None:
    async def write() -> None:  # the store opened from disk as the service opens it, with a small log bound
        store = MemoryStore(data_dir=lease.data_dir, max_log_bytes=1024)
        for i in range(50):
            await store.put(f"/kvbridge/test/{i}".encode(), f"value-{i}".encode())
        await store.close()

    asyncio.run(write())
    snapshot = lease.data_dir / "snapshot"
    data = snapshot.read_bytes()
    snapshot.write_bytes(data[:-25] if damage == "truncated" else data.replace(b"value-1", b"value-7", 1))
    code, output = lease.refused()
    print(f"damaged snapshot ({damage}): exit {code}: {output.strip()}")
    assert code == 1
    assert "Traceback" not in output
    assert f"snapshot {snapshot} is damaged" in output


def test_kill9_under_concurrent_grants_loses_nothing_acknowledged(lease: EmbeddedLease) -> None:
    acked: list[int] = []
    lease.start()
    for round_ in range(2):
        stop = threading.Event()
        errors: list[grpc.StatusCode] = []

        def grant(
            worker: int, round_: int = round_, stop: threading.Event = stop, errors: list[grpc.StatusCode] = errors
        ) -> None:
            channel, stub = _stub(lease)
            try:
                i = 0
                while not stop.is_set():
                    i += 1
                    request = lease_pb2.GrantLeaseRequest(
                        kind=lease_pb2.LEASE_KIND_ENTRY,
                        tenant="acme",
                        engine_id="eng-1",
                        model="m",
                        conversation_key=f"r{round_}-w{worker}-{i}",
                        ttl=duration_pb2.Duration(seconds=600),
                    )
                    try:
                        acked.append(stub.GrantLease(request, timeout=2).lease.lease_id)
                    except grpc.RpcError as err:
                        errors.append(err.code())
                        time.sleep(0.05)
            finally:
                channel.close()

        threads = [threading.Thread(target=grant, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        before = len(acked)
        deadline = time.monotonic() + 60
        while len(acked) < before + 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        lease.kill9()
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert len(acked) >= before + 100, "no grants acknowledged"
        assert set(errors) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}, errors
        lease.start()
        listed = _listed(lease)
        lost = set(acked) - listed
        print(
            f"kill -9 round {round_ + 1}: acknowledged {len(acked)} in all, lost {len(lost)}, "
            f"client errors {len(errors)}"
        )
        assert not lost
