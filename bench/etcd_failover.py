"""Lease-manager writes through an etcd leader kill, with etcd's default raft timings.

A 3-member etcd cluster (tests/fixtures/etcd.py) with etcd's *default* heartbeat (100 ms) and election
timeout (1000 ms), unless --raft fast (the test fixture's 10/100 ms). One lease manager (in this process, so
its leadership can be watched) on all three endpoints; --writers concurrent granters, each GrantLease with a
--deadline client deadline, retried at once on failure. Each round kills -9 the etcd leader, waits
--down-s, restarts it and waits until the cluster is healthy again. Per round:

- unavailable: kill -> first acknowledged grant among those started after the kill;
- longest gap between two acknowledged grants around the kill;
- whether the lease manager stepped down (its leadership sampled every 10 ms);
- errors seen by the clients, by code.

    .venv/bin/python bench/etcd_failover.py --rounds 8
    .venv/bin/python bench/etcd_failover.py --rounds 8 --leader-ttl 2 --attempt 5   # the settings before
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import duration_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.etcd import DEFAULT_RAFT_FLAGS, FAST_RAFT_FLAGS, EtcdCluster

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy


@dataclass
class Load:
    acks: list[tuple[float, float]] = field(default_factory=list)  # (started, acknowledged)
    errors: Counter[str] = field(default_factory=Counter)


async def _writer(
    stub: lease_pb2_grpc.LeaseServiceAsyncStub, w: int, deadline_s: float, load: Load, stop: asyncio.Event
) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        started = time.monotonic()
        try:
            await stub.GrantLease(
                lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_ENTRY,
                    tenant="acme",
                    engine_id="d0",
                    model="m",
                    conversation_key=f"w{w}-{i}",
                    ttl=duration_pb2.Duration(seconds=120),
                ),
                timeout=deadline_s,
            )
            load.acks.append((started, time.monotonic()))
        except grpc.aio.AioRpcError as exc:
            load.errors[exc.code().name] += 1
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)


async def _watch_leadership(app: LeaseApp, downs: list[float], stop: asyncio.Event) -> None:
    was = app.is_leader
    while not stop.is_set():
        now = app.is_leader
        if was and not now:
            downs.append(time.monotonic())
        was = now
        await asyncio.sleep(0.01)


async def run(args: argparse.Namespace) -> list[dict[str, object]]:
    flags = DEFAULT_RAFT_FLAGS if args.raft == "default" else FAST_RAFT_FLAGS
    cluster = EtcdCluster(3, base_dir=Path(tempfile.mkdtemp(prefix="etcd-failover-")), raft_flags=flags)
    cluster.start()
    store = EtcdStore(cluster.endpoints, timeout=args.store_timeout)
    policy = LeasePolicy(
        port=0,
        leader_ttl_s=args.leader_ttl,
        leader_refresh_s=args.leader_refresh,
        store_timeout_s=args.store_timeout,
        store_attempt_timeout_s=args.attempt,
    )
    app = LeaseApp(store, policy, ServerSettings(shutdown_grace_s=0.2))
    await app.start()
    rows: list[dict[str, object]] = []
    stop = asyncio.Event()
    try:
        async with asyncio.timeout(30):
            while not app.is_leader:  # noqa: ASYNC110 - polls the app
                await asyncio.sleep(0.05)
        load, downs = Load(), list[float]()
        async with grpc.aio.insecure_channel(app.address) as channel:
            stub = lease_pb2_grpc.LeaseServiceStub(channel)
            tasks = [asyncio.create_task(_writer(stub, w, args.deadline, load, stop)) for w in range(args.writers)]
            tasks.append(asyncio.create_task(_watch_leadership(app, downs, stop)))
            await asyncio.sleep(2.0)
            for r in range(args.rounds):
                leader = await asyncio.to_thread(cluster.leader)
                errors_before = Counter(load.errors)
                killed = time.monotonic()
                await asyncio.to_thread(cluster.kill_member, leader)
                await asyncio.sleep(args.down_s)
                await asyncio.to_thread(cluster.restart_member, leader)
                await asyncio.to_thread(cluster.leader)
                await asyncio.sleep(args.settle_s)
                after = [ack for started, ack in load.acks if started >= killed]
                window = sorted(ack for _, ack in load.acks if killed - 1.0 <= ack <= killed + args.down_s + 5)
                gaps = [b - a for a, b in itertools.pairwise(window)]
                row: dict[str, object] = {
                    "round": r + 1,
                    "unavailable_s": round(min(after) - killed, 3) if after else None,
                    "longest_gap_s": round(max(gaps), 3) if gaps else None,
                    "stepped_down": any(killed <= d <= time.monotonic() for d in downs),
                    "errors": dict(load.errors - errors_before),
                }
                rows.append(row)
                print(row, flush=True)
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        stop.set()
        await app.stop(0.2)
        await store.close()
        cluster.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = LeasePolicy()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--raft", choices=["default", "fast"], default="default")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=5.0, help="client deadline per GrantLease (SDK default)")
    parser.add_argument("--down-s", type=float, default=5.0, help="how long the killed member stays down")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause after the restart before the next round")
    parser.add_argument("--leader-ttl", type=int, default=defaults.leader_ttl_s)
    parser.add_argument("--leader-refresh", type=float, default=defaults.leader_refresh_s)
    parser.add_argument("--store-timeout", type=float, default=defaults.store_timeout_s)
    parser.add_argument(
        "--attempt",
        type=float,
        default=defaults.store_attempt_timeout_s,
        help="store_attempt_timeout_s (= --store-timeout: one attempt, the old behaviour)",
    )
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    unavailable = [float(r["unavailable_s"]) for r in rows if r["unavailable_s"] is not None]  # type: ignore[arg-type]
    print(
        f"\nsettings: raft={args.raft} leader_ttl={args.leader_ttl}s refresh={args.leader_refresh}s "
        f"store_timeout={args.store_timeout}s attempt={args.attempt}s writers={args.writers} "
        f"deadline={args.deadline}s"
    )
    if unavailable:
        print(
            f"unavailable writes after an etcd leader kill: median {statistics.median(unavailable):.2f}s, "
            f"min {min(unavailable):.2f}s, max {max(unavailable):.2f}s over {len(unavailable)} rounds; "
            f"lease-manager step-downs: {sum(bool(r['stepped_down']) for r in rows)}/{len(rows)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
