"""Registry benchmark: lookups/s, registrations/s (embedded and etcd), p50/p99, bytes per entry.

    .venv/bin/python bench/registry_bench.py [--etcd-bin /usr/bin/etcd] [--quick]

Spawns its own single-member etcd (temp dir) for the etcd runs. Prints a Markdown
report (bench/results/registry.md holds the committed one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Store
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.registry.index import RegistryIndex

SECRET = b"bench-secret-0123456789abcdef"
MODEL = "bench/model"
BLOCK = 16


class NoRelease:
    async def revoke(self, lease_id: int, reason: Any) -> None:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_etcd(binary: str) -> tuple[subprocess.Popen[bytes], str, str]:
    data = tempfile.mkdtemp(prefix="bench-etcd-")
    cport, pport = free_port(), free_port()
    proc = subprocess.Popen(
        [binary, f"--data-dir={data}/d", f"--listen-client-urls=http://127.0.0.1:{cport}",
         f"--advertise-client-urls=http://127.0.0.1:{cport}", f"--listen-peer-urls=http://127.0.0.1:{pport}",
         f"--initial-advertise-peer-urls=http://127.0.0.1:{pport}",
         f"--initial-cluster=default=http://127.0.0.1:{pport}", "--log-level=error", "--logger=zap"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{cport}", data


def tokens_for(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt) % 150000 for i in range(n)]


def chain(tokens: list[int]) -> list[bytes]:
    return hashchain.chain(SECRET, "acme", MODEL, "", BLOCK, tokens)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def timed_concurrent(n: int, concurrency: int, op: Callable[[int], Awaitable[Any]]) -> tuple[float, list[float]]:
    latencies: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            t = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), latencies


def _client_proc(address: str, raw: bytes, n: int, concurrency: int, out: Any) -> None:
    """A load-generating client in its own process (so the server's process only serves)."""

    async def run() -> tuple[float, list[float]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            req = registry_pb2.LookupEntryRequest.FromString(raw)
            await stub.LookupEntry(req)
            return await timed_concurrent(n, concurrency, lambda i: stub.LookupEntry(req))

    rate, lat = asyncio.run(run())
    out.put((rate, lat))


async def grpc_lookups_from_processes(address: str, req: registry_pb2.LookupEntryRequest, n: int,
                                      procs: int) -> tuple[float, list[float]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_client_proc, args=(address, req.SerializeToString(), n // procs, 32, queue))
               for _ in range(procs)]
    for w in workers:
        w.start()
    results = [await asyncio.to_thread(queue.get) for _ in workers]
    for w in workers:
        w.join()
    return sum(r for r, _ in results), [x for _, lat in results for x in lat]


async def put_lease(store: Store, keys: KeyLayout, kind: int, conv: str = "", engine: str = "d0") -> int:
    lease_id = int.from_bytes(os.urandom(7), "big") + 1
    rec = lease_pb2.Lease(lease_id=lease_id, kind=kind, tenant="" if kind == lease_pb2.LEASE_KIND_NODE else "acme",  # type: ignore[arg-type]
                          engine_id=engine, model=MODEL if kind == lease_pb2.LEASE_KIND_ENTRY else "",
                          conversation_key=conv)
    await store.put(keys.lease(lease_id), rec.SerializeToString())
    return lease_id


def entry_request(tokens: list[int], conv: str, lease_id: int, epoch: int = 1) -> registry_pb2.RegisterEntryRequest:
    n = -(-len(tokens) // BLOCK)
    return registry_pb2.RegisterEntryRequest(request_id=uuid.uuid4().hex, entry=registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv), engine_id="d0",
        engine_request_id=f"r-{conv}", block_ids=[types_pb2.BlockIds(ids=list(range(n)))], block_size=BLOCK,
        token_count=len(tokens), block_hashes=chain(tokens), lease_id=lease_id, epoch=epoch))


async def run_backend(name: str, store: Store, args: argparse.Namespace) -> dict[str, Any]:
    keys = KeyLayout()
    app = RegistryApp(store, settings=RegistrySettings(port=0, max_entries_per_tenant=1_000_000),
                      server_settings=ServerSettings(shutdown_grace_s=0, max_concurrent_rpcs=4096),
                      keys=keys, releaser=NoRelease())
    await app.start()
    out: dict[str, Any] = {"backend": name}
    try:
        async with grpc.aio.insecure_channel(app.address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            node = await put_lease(store, keys, lease_pb2.LEASE_KIND_NODE)
            await stub.RegisterEngine(registry_pb2.RegisterEngineRequest(engine=types_pb2.Engine(
                engine_id="d0", role=types_pb2.ENGINE_ROLE_DECODE, model=MODEL, kv_host="10.0.0.1", kv_port=5600,
                block_size=BLOCK, kv_group_count=1, node_lease_id=node)))
            history = tokens_for(8192)
            n_reg = args.registrations
            leases = [await put_lease(store, keys, lease_pb2.LEASE_KIND_ENTRY, f"c{i}") for i in range(n_reg)]
            requests = [entry_request(history, f"c{i}", leases[i]) for i in range(n_reg)]
            rate, lat = await timed_concurrent(n_reg, 64, lambda i: stub.RegisterEntry(requests[i]))
            out["reg_rate"], out["reg_p50"], out["reg_p99"] = rate, pct(lat, 0.5), pct(lat, 0.99)
            prompt = chain([*history, *tokens_for(200, 3)])
            keyed = registry_pb2.LookupEntryRequest(tenant="acme", model=MODEL, conversation_key="c1",
                                                    block_hashes=prompt, block_size=BLOCK)
            rate, lat = await grpc_lookups_from_processes(app.address, keyed, args.lookups, args.client_procs)
            out["grpc_lookup_rate"], out["grpc_p50"], out["grpc_p99"] = rate, pct(lat, 0.5), pct(lat, 0.99)
            from kvbridge_services.common.auth import DEV_PRINCIPAL

            lat = []
            t0 = time.perf_counter()
            for _ in range(args.lookups):
                t = time.perf_counter()
                app.registry.lookup(DEV_PRINCIPAL, keyed)
                lat.append(time.perf_counter() - t)
            out["core_lookup_rate"] = args.lookups / (time.perf_counter() - t0)
            out["core_p50"], out["core_p99"] = pct(lat, 0.5), pct(lat, 0.99)
            content = registry_pb2.LookupEntryRequest(tenant="acme", model=MODEL, block_hashes=prompt,
                                                      block_size=BLOCK)
            t0 = time.perf_counter()
            for _ in range(args.lookups // 4):
                resp = app.registry.lookup(DEV_PRINCIPAL, content)
            out["content_lookup_rate"] = (args.lookups // 4) / (time.perf_counter() - t0)
            assert resp.verdict == registry_pb2.LOOKUP_VERDICT_HIT
            kv = await store.get(keys.entry("acme", MODEL, "c1"))
            assert kv is not None
    finally:
        await app.stop(0)
    return out


def entry_sizes() -> list[tuple[int, int, int, int]]:
    """(tokens, bytes of the full chain, bytes of the stored Entry value, bytes in the in-memory index)."""
    rows = []
    for n_tokens in (2048, 8192, 24576):
        req = entry_request(tokens_for(n_tokens), "conv-000001", 12345678901, 3)
        from kvbridge_services.registry.hashrecord import HashRecord

        rec = HashRecord.from_chain(list(req.entry.block_hashes), 4)
        stored = registry_pb2.Entry()
        stored.CopyFrom(req.entry)
        del stored.block_hashes[:]
        stored.block_hashes.extend(rec.checkpoints)
        stored.chain_stride, stored.final_block_hash = 4, rec.final
        stored.register_time.GetCurrentTime()
        index = RegistryIndex()
        count = 500
        copies = []
        for i in range(count):
            e = registry_pb2.Entry()
            e.CopyFrom(stored)
            e.key.conversation_key = f"conv-{i:06d}"
            copies.append(e.SerializeToString())
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i, raw in enumerate(copies):
            index.put_entry(registry_pb2.Entry.FromString(raw), i + 1)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        mem = sum(s.size_diff for s in after.compare_to(before, "filename")) // count
        rows.append((n_tokens, 16 * len(req.entry.block_hashes), len(stored.SerializeToString()), mem))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--etcd-bin", default=shutil.which("etcd") or "/usr/bin/etcd")
    parser.add_argument("--registrations", type=int, default=2000)
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument("--client-procs", type=int, default=1, help="load-generating client processes")
    args = parser.parse_args()
    results = [await run_backend("embedded (MemoryStore)", MemoryStore(), args)]
    proc, endpoint, data = spawn_etcd(args.etcd_bin)
    try:
        from kvbridge_services.common.store.etcd import EtcdStore

        store = EtcdStore([endpoint])
        for _ in range(100):
            try:
                await store.current_revision(timeout=0.5)
                break
            except Exception:  # noqa: BLE001 - etcd still starting
                await asyncio.sleep(0.1)
        results.append(await run_backend("etcd 3.4 (1 member, local disk)", store, args))
        await store.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
    print("| backend | registrations/s | reg p50 ms | reg p99 ms | lookups/s gRPC | gRPC p50 ms | gRPC p99 ms "
          "| lookups/s core (keyed, in-process) | core p50 ms | core p99 ms | content lookups/s core |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['backend']} | {r['reg_rate']:.0f} | {r['reg_p50']:.1f} | {r['reg_p99']:.1f} "
              f"| {r['grpc_lookup_rate']:.0f} | {r['grpc_p50']:.1f} | {r['grpc_p99']:.1f} "
              f"| {r['core_lookup_rate']:.0f} | {r['core_p50']:.3f} | {r['core_p99']:.3f} "
              f"| {r['content_lookup_rate']:.0f} |")
    print()
    print("| tokens (block 16) | full chain bytes | stored Entry bytes (etcd value) | in-memory index bytes/entry |")
    print("|---|---|---|---|")
    for n, full, stored, mem in entry_sizes():
        print(f"| {n} | {full} | {stored} | {mem} |")


if __name__ == "__main__":
    asyncio.run(main())
