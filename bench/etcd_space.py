"""etcd space per turn and under periodic compaction, at compressed scale (issue 29, item 3; docs/etcd-space.md).

The connector's per-turn write path through the real lease manager and registry (in this process, on a real etcd,
over gRPC): GrantLease (an entry lease), RegisterEntry (entry + idempotency record; the registry supersedes the
conversation's previous entry and has its lease revoked). One decode engine registered with a node lease.

1. ``bytes``: etcd with no compaction; --measure-turns turns; bytes per turn = growth of etcd's database in use
   (``dbSizeInUse``, and the file ``dbSize``) divided by the turns.
2. ``steady``: for each R:Q in --runs, etcd with a Q MiB quota and ``--auto-compaction-mode=periodic
   --auto-compaction-retention=R``, turns paced at --rate for --duration-s; the database size sampled every second.
   The model of docs/etcd-space.md: what etcd holds at most is the live entries + rate x (idempotency share of the
   bytes x (T + 2R) + the rest x 2R), T the registry's idempotency TTL (--idempotency-ttl-s; its records live T/2 to
   T, then their deletion stays in the history until compacted) and 2R the compaction history; the idempotency
   record is the size of the entry (half the turn's bytes). A run whose model exceeds the quota should reach
   NOSPACE, one under it should not.

    .venv/bin/python bench/etcd_space.py --rate 100 --idempotency-ttl-s 30 --runs 15s:64,15s:32 --duration-s 180 \
        --out bench/results/etcd_space.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.etcd import DEFAULT_RAFT_FLAGS, EtcdServer, member_status

from kvbridge import hashchain
from kvbridge.errors import from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack

MODEL, TENANT, ENGINE = "bench-model", "acme", "d0"
SECRET = bytes(range(16))
MIB = 1024 * 1024
_UNITS = {"s": 1, "m": 60, "h": 3600}


@dataclass
class Run:
    turns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, dbSize, dbSizeInUse)
    first_nospace_s: float | None = None


class Turns:
    """The per-turn writes of a decode engine's connector, over gRPC to the in-process services."""

    def __init__(self, stack: ServiceStack, tokens: int, block: int, conversations: int) -> None:
        assert stack.lease is not None and stack.registry is not None
        self._lch = grpc.aio.insecure_channel(stack.lease.address)
        self._rch = grpc.aio.insecure_channel(stack.registry.address)
        self.leases = lease_pb2_grpc.LeaseServiceStub(self._lch)
        self.registry = registry_pb2_grpc.RegistryServiceStub(self._rch)
        self.block, self.tokens = block, tokens
        self.hashes = hashchain.chain(SECRET, TENANT, MODEL, "", block, list(range(tokens)))
        self.blocks = [types_pb2.BlockIds(ids=list(range(len(self.hashes))))]
        self.conversations = conversations
        self.epochs: dict[int, int] = {}
        self.ids = itertools.count()

    async def register_engine(self) -> None:
        node = await self.leases.GrantLease(
            lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id=ENGINE, ttl=Duration(seconds=600)),
            timeout=10,
        )
        await self.registry.RegisterEngine(
            registry_pb2.RegisterEngineRequest(
                engine=types_pb2.Engine(
                    engine_id=ENGINE,
                    role=types_pb2.ENGINE_ROLE_DECODE,
                    model=MODEL,
                    http_url="http://127.0.0.1:9",
                    kv_host="127.0.0.1",
                    kv_port=9,
                    dp_size=1,
                    tp_size=1,
                    block_size=self.block,
                    kv_group_count=1,
                    node_lease_id=node.lease.lease_id,
                )
            ),
            timeout=10,
        )

    async def turn(self) -> None:
        n = next(self.ids)
        c = n % self.conversations
        conv = f"c{c}"
        epoch = self.epochs.get(c, 0) + 1
        self.epochs[c] = epoch
        grant = await self.leases.GrantLease(
            lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant=TENANT,
                engine_id=ENGINE,
                model=MODEL,
                conversation_key=conv,
                ttl=Duration(seconds=600),
                request_id=f"g-{n}",
                retained_tokens=self.tokens,
            ),
            timeout=10,
        )
        await self.registry.RegisterEntry(
            registry_pb2.RegisterEntryRequest(
                request_id=f"r-{n}",
                entry=registry_pb2.Entry(
                    key=registry_pb2.EntryKey(tenant=TENANT, model=MODEL, conversation_key=conv),
                    engine_id=ENGINE,
                    engine_request_id=f"req-{n}",
                    block_ids=self.blocks,
                    block_size=self.block,
                    token_count=len(self.hashes) * self.block,
                    block_hashes=self.hashes,
                    chain_stride=1,
                    final_block_hash=self.hashes[-1],
                    lease_id=grant.lease.lease_id,
                    epoch=epoch,
                ),
            ),
            timeout=10,
        )

    async def close(self) -> None:
        await self._lch.close()
        await self._rch.close()


def _seconds(retention: str) -> int:
    m = re.fullmatch(r"(\d+)([smh])", retention)
    if not m:
        raise SystemExit(f"retention {retention!r}: e.g. 30s, 5m")
    return int(m[1]) * _UNITS[m[2]]


def _status(server: EtcdServer) -> tuple[int, int]:
    s = member_status(server.endpoint, timeout=5)
    return int(s.dbSize), int(s.dbSizeInUse)


async def _with_stack(server: EtcdServer, fn: Any, idempotency_ttl_s: int) -> Any:
    store = EtcdStore([server.endpoint], timeout=5.0)
    try:
        async with ServiceStack(
            store,
            lease_policy=LeasePolicy(port=0, store_timeout_s=5.0),
            registry=RegistrySettings(port=0, idempotency_ttl_s=idempotency_ttl_s),
            server=ServerSettings(shutdown_grace_s=0.2),
            stop_grace_s=0.2,
        ) as stack:
            return await fn(stack)
    finally:
        await store.close()


async def _paced(turns: Turns, run: Run, rate: float, duration_s: float, server: EtcdServer) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    inflight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        try:
            await turns.turn()
            run.turns += 1
        except grpc.aio.AioRpcError as exc:
            reason = from_rpc_error(exc).reason or exc.code().name
            run.errors[reason] = run.errors.get(reason, 0) + 1
            if reason == "STORE_NO_SPACE" and run.first_nospace_s is None:
                run.first_nospace_s = loop.time() - started

    async def sampler() -> None:
        while True:
            size, in_use = await asyncio.to_thread(_status, server)
            run.samples.append((loop.time() - started, size, in_use))
            await asyncio.sleep(1.0)

    sampling = asyncio.create_task(sampler())
    for i in itertools.count():
        due = started + i / rate
        if due - started >= duration_s:
            break
        await asyncio.sleep(max(0.0, due - loop.time()))
        task = asyncio.create_task(one())
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    await asyncio.gather(*inflight)
    sampling.cancel()
    await asyncio.gather(sampling, return_exceptions=True)


async def measure_bytes(args: argparse.Namespace, base: Path) -> tuple[float, float, float]:
    """Bytes per turn (in use, file) and the turns/s reached, with no compaction."""
    server = EtcdServer(base_dir=base / "bytes", raft_flags=DEFAULT_RAFT_FLAGS)
    server.start()
    try:

        async def go(stack: ServiceStack) -> tuple[float, float, float]:
            turns = Turns(stack, args.tokens, args.block, args.conversations)
            try:
                await turns.register_engine()
                for _ in range(args.conversations):  # every conversation live once: the next turns supersede
                    await turns.turn()
                size0, use0 = await asyncio.to_thread(_status, server)
                started = time.monotonic()
                sem = asyncio.Semaphore(8)

                async def one() -> None:
                    async with sem:
                        await turns.turn()

                await asyncio.gather(*(one() for _ in range(args.measure_turns)))
                elapsed = time.monotonic() - started
                size1, use1 = await asyncio.to_thread(_status, server)
                n = args.measure_turns
                return (use1 - use0) / n, (size1 - size0) / n, n / elapsed
            finally:
                await turns.close()

        result: tuple[float, float, float] = await _with_stack(server, go, args.idempotency_ttl_s)
        return result
    finally:
        server.close()


async def steady(args: argparse.Namespace, base: Path, retention: str, quota_mib: int) -> tuple[Run, int]:
    flags = (
        *DEFAULT_RAFT_FLAGS,
        "--auto-compaction-mode=periodic",
        f"--auto-compaction-retention={retention}",
    )
    server = EtcdServer(
        base_dir=base / f"steady-{retention}-{quota_mib}", raft_flags=flags, quota_backend_bytes=quota_mib * MIB
    )
    server.start()
    run = Run()
    try:

        async def go(stack: ServiceStack) -> int:
            turns = Turns(stack, args.tokens, args.block, args.conversations)
            try:
                await turns.register_engine()
                base_size, _ = await asyncio.to_thread(_status, server)
                await _paced(turns, run, args.rate, args.duration_s, server)
                return base_size
            finally:
                await turns.close()

        base_size: int = await _with_stack(server, go, args.idempotency_ttl_s)
        return run, base_size
    finally:
        server.close()


def _model(args: argparse.Namespace, per_turn: float, retention_s: int, base_size: int) -> float:
    """docs/etcd-space.md's bound on what etcd holds."""
    idem = per_turn / 2
    rate, ttl = float(args.rate), float(args.idempotency_ttl_s)
    held = rate * (idem * (ttl + 2 * retention_s) + (per_turn - idem) * 2 * retention_s)
    conversations = int(args.conversations)
    return base_size + conversations * per_turn + held


def _report(
    args: argparse.Namespace, per_turn: tuple[float, float, float], runs: list[tuple[str, int, Run, int]]
) -> str:
    in_use, file_growth, reached = per_turn
    lines = [
        "# etcd space per turn and under periodic compaction (compressed scale)",
        "",
        f"Command: `.venv/bin/python bench/etcd_space.py {' '.join(sys.argv[1:])}`",
        "",
        f"Write path: GrantLease + RegisterEntry through the in-process lease manager and registry on one etcd "
        f"({args.tokens} tokens, block {args.block}: {args.tokens // args.block} hashes per entry), "
        f"{args.conversations} conversations round-robin (each turn supersedes the conversation's entry).",
        "",
        f"**Bytes per turn** (no compaction, {args.measure_turns} turns, {reached:.0f} turns/s reached): "
        f"**{in_use / 1e3:.1f} KB** of database in use, {file_growth / 1e3:.1f} KB of file growth.",
        "",
        f"**Under periodic compaction**, {args.rate:g} turns/s for {args.duration_s:g} s, registry idempotency TTL "
        f"{args.idempotency_ttl_s} s:",
        "",
        "| retention R | quota | model: live + rate x (idem x (T + 2R) + rest x 2R) | measured peak in use | "
        "peak file | turns | first STORE_NO_SPACE | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for retention, quota_mib, run, base_size in runs:
        model = _model(args, in_use, _seconds(retention), base_size)
        peak_use = max((s[2] for s in run.samples), default=0)
        peak_size = max((s[1] for s in run.samples), default=0)
        nospace = f"{run.first_nospace_s:.0f} s" if run.first_nospace_s is not None else "never"
        verdict = "over" if model > quota_mib * MIB else "under"
        lines.append(
            f"| {retention} | {quota_mib} MiB | {model / MIB:.1f} MiB ({verdict} the quota) | "
            f"{peak_use / MIB:.1f} MiB | {peak_size / MIB:.1f} MiB | {run.turns} | {nospace} | {run.errors or 'none'} |"
        )
    lines += [
        "",
        "Database size over time (s: file MiB / in-use MiB), every 10th sample:",
        "",
    ]
    for retention, quota_mib, run, _ in runs:
        series = ", ".join(f"{t:.0f}: {s / MIB:.1f}/{u / MIB:.1f}" for t, s, u in run.samples[::10])
        lines.append(f"- {retention}, {quota_mib} MiB: {series}")
    return "\n".join(lines) + "\n"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--measure-turns", type=int, default=1000)
    p.add_argument("--rate", type=float, default=30.0, help="turns/s in the steady runs")
    p.add_argument("--runs", default="15s:64,15s:32", help="R:quota MiB of each steady run")
    p.add_argument("--idempotency-ttl-s", type=int, default=600, help="the registry's (shipped: 600)")
    p.add_argument("--duration-s", type=float, default=90.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="etcd-space-") as tmp:
        base = Path(tmp)
        per_turn = await measure_bytes(args, base)
        print(
            f"bytes per turn: in use {per_turn[0]:.0f}, file {per_turn[1]:.0f}; {per_turn[2]:.0f} turns/s", flush=True
        )
        runs = []
        for spec in args.runs.split(","):
            retention, quota = spec.split(":")
            run, base_size = await steady(args, base, retention, int(quota))
            print(f"{spec}: turns={run.turns} errors={run.errors} nospace={run.first_nospace_s}", flush=True)
            runs.append((retention, int(quota), run, base_size))
    report = _report(args, per_turn, runs)
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    asyncio.run(main())
