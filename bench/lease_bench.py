"""Lease-manager benchmark: 100,000 active leases on one replica.

Starts ``python -m kvbridge_services.lease`` as a subprocess (embedded store, or
etcd when --etcd is given: an etcd it starts itself in a temp dir), then from
this process:
  1. grants --leases ENTRY leases (concurrent GrantLease calls), measures server RSS growth;
  2. renews the renewed share through --streams KeepAlive streams of --batch ids per
     message for --seconds, counting renewals/s;
  3. meanwhile --expiring leases (TTLs spread over 3..8 s) are never renewed; a
     WatchLeases subscriber on their engine records ENDED time - deadline (lateness);
  4. reads the server's store-traffic counters (its stats log line) to get store ops per renewal.

    .venv/bin/python bench/lease_bench.py --store memory
    .venv/bin/python bench/lease_bench.py --store etcd
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import duration_pb2

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the shared test helpers (tests/fixtures)
from tests.fixtures.common import free_port  # noqa: E402

ENTRY = lease_pb2.LEASE_KIND_ENTRY
STATS = re.compile(
    r"stats leases=(\d+) renewals=(\d+) watchers=\d+ store_txns=(\d+) store_puts=(\d+) "
    r"store_deletes=(\d+) store_gets=(\d+)"
)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            shutil.which("etcd") or "etcd",
            "--data-dir",
            str(workdir / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
            "--quota-backend-bytes",
            str(4 * 2**30),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{client}"


def start_lease_manager(port: int, etcd: str | None, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KVBRIDGE_LEASE_PORT": str(port),
        "KVBRIDGE_LEASE_STATS_LOG_INTERVAL_S": "1",
        "KVBRIDGE_LEASE_MAX_IDS_PER_KEEPALIVE": "10000",
        # /metrics off: the leader and the failover phase's standby would both take the default port.
        "KVBRIDGE_LEASE_METRICS_PORT": "0",
    }
    env.pop("KVBRIDGE_ETCD_ENDPOINTS", None)
    if etcd:
        env["KVBRIDGE_ETCD_ENDPOINTS"] = etcd
    return subprocess.Popen(
        [sys.executable, "-m", "kvbridge_services.lease"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("wb"),
    )


def last_stats(log_path: Path) -> tuple[int, ...]:
    found = STATS.findall(log_path.read_text(errors="replace"))
    return tuple(int(x) for x in found[-1]) if found else (0,) * 6


async def grant_all(
    stub: lease_pb2_grpc.LeaseServiceAsyncStub, specs: list[tuple[str, str, float]], concurrency: int
) -> list[int]:
    ids: list[int] = [0] * len(specs)
    queue = iter(range(len(specs)))

    async def worker() -> None:
        for i in queue:
            engine, conv, ttl_s = specs[i]
            ttl = duration_pb2.Duration()
            ttl.FromNanoseconds(int(ttl_s * 1e9))
            request = lease_pb2.GrantLeaseRequest(
                kind=ENTRY, tenant=f"t{i % 16}", engine_id=engine, model="m", conversation_key=conv, ttl=ttl
            )
            ids[i] = (await stub.GrantLease(request, timeout=30)).lease.lease_id

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


async def next_statuses(
    call: grpc.aio.StreamStreamCall[lease_pb2.KeepAliveRequest, lease_pb2.KeepAliveResponse],
) -> list[lease_pb2.LeaseStatus]:
    """The statuses of the next KeepAlive response; the stream ending instead fails the run."""
    response = await call.read()
    if not isinstance(response, lease_pb2.KeepAliveResponse):
        raise RuntimeError(f"the KeepAlive stream ended ({response!r})")
    return list(response.statuses)


async def renew_loop(
    stub: lease_pb2_grpc.LeaseServiceAsyncStub,
    ids: list[int],
    batch: int,
    stop: asyncio.Event,
    counts: list[int],
    pace: list[float],
) -> None:
    """Renew ``ids`` round-robin, ``batch`` per message; ``pace[0]`` > 0 caps this stream's renewals/s."""
    call = stub.KeepAlive()
    position = 0
    next_send = time.perf_counter()
    while not stop.is_set():
        if pace[0] > 0:
            next_send += batch / pace[0]
            await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
        chunk = ids[position : position + batch] or ids[:batch]
        position = position + batch if position + batch < len(ids) else 0
        await call.write(lease_pb2.KeepAliveRequest(lease_ids=chunk))
        statuses = await next_statuses(call)
        counts[0] += len(statuses)
        counts[1] += sum(1 for s in statuses if not s.alive)
    await call.done_writing()


async def watch_lateness(
    stub: lease_pb2_grpc.LeaseServiceAsyncStub, engine: str, expected: int, lateness: list[float], ready: asyncio.Event
) -> None:
    call = stub.WatchLeases(lease_pb2.WatchLeasesRequest(engine_id=engine))
    async for message in call:
        now = time.time()
        if message.snapshot_complete:
            ready.set()
        for event in message.events:
            if event.type == lease_pb2.LeaseEvent.TYPE_ENDED:
                deadline = event.lease.deadline.seconds + event.lease.deadline.nanos / 1e9
                lateness.append(now - deadline)
        if len(lateness) >= expected:
            call.cancel()
            return


async def failover_phase(
    args: argparse.Namespace, etcd: str | None, leader: subprocess.Popen[bytes], ids: list[int], workdir: Path
) -> None:
    """Phase 3 (etcd): start a standby, kill -9 the leader, time until the standby serves, check every lease."""
    port = free_port()
    log_path = workdir / "standby.log"
    standby = start_lease_manager(port, etcd, log_path)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = lease_pb2_grpc.LeaseServiceStub(channel)
    try:
        try:
            async with asyncio.timeout(60):  # the standby is up and watching the leader key
                while "waiting for leadership" not in log_path.read_text(errors="replace"):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
        except TimeoutError:
            tail = log_path.read_text(errors="replace")[-3000:]
            sys.exit(f"the standby did not come up within 60 s; its log:\n{tail}")
        await asyncio.sleep(1)
        leader.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        print(f"  killed the leader at {time.strftime('%H:%M:%S')}")
        probe = lease_pb2.GetLeaseRequest(lease_id=ids[0])
        while True:
            try:
                await stub.GetLease(probe, timeout=1)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        took = time.perf_counter() - killed
        call = stub.KeepAlive()
        alive = 0
        for start in range(0, len(ids), 10_000):
            await call.write(lease_pb2.KeepAliveRequest(lease_ids=ids[start : start + 10_000]))
            alive += sum(1 for s in await next_statuses(call) if s.alive)
        await call.done_writing()
        for line in log_path.read_text(errors="replace").splitlines():
            if "election" in line or "recovered" in line:
                print("  standby:", line[:160])
        print(
            f"phase 3 failover: kill -9 leader -> standby served in {took:.2f}s with {len(ids)} leases to load; "
            f"{alive}/{len(ids)} leases alive after takeover"
        )
    finally:
        await channel.close()
        standby.send_signal(signal.SIGTERM)
        standby.wait(15)


def traffic(label: str, before: tuple[int, ...], after: tuple[int, ...]) -> str:
    renewals = after[1] - before[1]
    txns, puts, deletes, gets = (after[k] - before[k] for k in (2, 3, 4, 5))
    if not renewals:
        return f"{label} store traffic: no renewals seen"
    return (
        f"{label} store traffic: {txns} txns, {puts} puts, {deletes} deletes, {gets} gets for {renewals} "
        f"renewals = {txns / renewals:.5f} txns and {puts / renewals:.4f} puts per renewal"
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="lease-bench-"))
    etcd_proc, etcd = start_etcd(workdir) if args.store == "etcd" else (None, None)
    port = free_port()
    log_path = workdir / "lease.log"
    if etcd_proc is not None:
        await asyncio.sleep(2)
    server = start_lease_manager(port, etcd, log_path)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = lease_pb2_grpc.LeaseServiceStub(channel)
    try:
        async with asyncio.timeout(30):
            while "recovered leases" not in log_path.read_text(errors="replace"):  # noqa: ASYNC110 - polls a file
                await asyncio.sleep(0.1)
        rss_before = rss_kib(server.pid)
        renewed_n = args.leases - args.expiring
        specs = [(f"eng-{i % 8}", f"conv-{i}", args.ttl) for i in range(renewed_n)]
        t0 = time.perf_counter()
        renewed_ids = await grant_all(stub, specs, args.concurrency)
        grant_s = time.perf_counter() - t0
        await asyncio.sleep(1.5)
        rss_after = rss_kib(server.pid)

        # Expiring leases on their own engine, watched; TTLs spread so expiries overlap the renewal load.
        lateness: list[float] = []
        ready = asyncio.Event()
        watcher = asyncio.create_task(watch_lateness(stub, "eng-expiring", args.expiring, lateness, ready))
        await ready.wait()
        stop = asyncio.Event()
        counts = [0, 0]
        pace = [0.0]
        chunks = [renewed_ids[i :: args.streams] for i in range(args.streams)]
        renewers = [asyncio.create_task(renew_loop(stub, c, args.batch, stop, counts, pace)) for c in chunks]
        # Phase 1: renewal throughput, unpaced.
        await asyncio.sleep(2)  # warm up
        stats0, c0, t1 = last_stats(log_path), counts[0], time.perf_counter()
        await asyncio.sleep(args.seconds)
        c1, t2 = counts[0], time.perf_counter()
        await asyncio.sleep(1.2)
        stats1 = last_stats(log_path)
        rate = (c1 - c0) / (t2 - t1)
        # Phase 2: expiry precision under a steady renewal load of --paced-rate.
        pace[0] = args.paced_rate / args.streams
        await asyncio.sleep(2)
        stats2, c2, t3 = last_stats(log_path), counts[0], time.perf_counter()
        exp_specs = [("eng-expiring", f"exp-{i}", 3.0 + 5.0 * i / args.expiring) for i in range(args.expiring)]
        await grant_all(stub, exp_specs, args.concurrency)
        async with asyncio.timeout(60):
            await watcher
        c3, t4 = counts[0], time.perf_counter()
        await asyncio.sleep(1.2)
        stats3 = last_stats(log_path)
        stop.set()
        await asyncio.gather(*renewers)
        print(f"store={args.store} leases={args.leases} (renewed {renewed_n}, expiring {args.expiring})")
        print(
            f"grant: {renewed_n} leases in {grant_s:.1f}s = {renewed_n / grant_s:.0f}/s "
            f"(concurrency {args.concurrency})"
        )
        print(
            f"memory: server RSS {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB = "
            f"{(rss_after - rss_before) * 1024 / renewed_n:.0f} bytes/lease (table + embedded store if any)"
        )
        print(
            f"phase 1 renewals: {rate:.0f}/s over {t2 - t1:.1f}s ({args.streams} KeepAlive streams x "
            f"{args.batch} ids/msg), not-alive answers {counts[1]}"
        )
        print(traffic("phase 1", stats0, stats1))
        print(f"phase 2 paced renewals: {(c3 - c2) / (t4 - t3):.0f}/s over {t4 - t3:.1f}s")
        print(
            f"phase 2 expiry lateness (ENDED received - deadline) over {len(lateness)} leases: "
            f"p50 {pct(lateness, 0.5) * 1000:.0f} ms, p99 {pct(lateness, 0.99) * 1000:.0f} ms, "
            f"max {max(lateness) * 1000:.0f} ms"
        )
        print(traffic("phase 2", stats2, stats3))
        if args.failover:
            await failover_phase(args, etcd, server, renewed_ids, workdir)
    except BaseException:
        print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        await channel.close()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(15)
        if etcd_proc is not None:
            etcd_proc.terminate()
            etcd_proc.wait(15)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=["memory", "etcd"], default="memory")
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument("--expiring", type=int, default=5_000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--failover", action="store_true", help="etcd only: also time a kill -9 failover")
    parser.add_argument("--ttl", type=float, default=300.0, help="TTL of the renewed leases (s)")
    parser.add_argument("--paced-rate", type=float, default=25_000, help="renewals/s during the expiry phase")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
