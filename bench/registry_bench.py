"""Registry benchmark: lookups/s, registrations/s (embedded and etcd), p50/p99, bytes per entry.

    .venv/bin/python bench/registry_bench.py [--etcd-bin /usr/bin/etcd] [--client-procs 1,2] [--plot out.png]

Spawns its own single-member etcd (temp dir) for the etcd runs. Per backend:
registrations without and with group commit (docs/adr/0005), then gRPC lookups
with the repeated and the packed hash form from separate client processes,
recording the server process's CPU seconds per operation (/proc/<pid>/stat).
Prints a Markdown report (bench/results/registry.md holds the committed one).

    .venv/bin/python bench/registry_bench.py --serve-only --serve-processes 1,2

Serving capacity: ``python -m kvbridge_services.registry`` itself (on etcd, with 1 and N server processes,
KVBRIDGE_REGISTRY_SERVE_PROCESSES) driven by h2load (Debian package nghttp2-client: a C load generator that
costs far less CPU than a Python gRPC client) with a prebuilt gRPC request; every answer is checked to be a hit
through the registry's own lookup counters, and the CPU of all server processes is read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the shared test helpers (tests/fixtures)
from tests.fixtures.common import consecutive_free_ports, free_port  # noqa: E402

SECRET = b"bench-secret-0123456789abcdef"
MODEL = "bench/model"
BLOCK = 16


class NoRelease:
    async def revoke(self, lease_id: int, reason: Any) -> None:
        return None


def spawn_etcd(binary: str) -> tuple[subprocess.Popen[bytes], str, str]:
    data = tempfile.mkdtemp(prefix="bench-etcd-")
    cport, pport = free_port(), free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--data-dir={data}/d",
            f"--listen-client-urls=http://127.0.0.1:{cport}",
            f"--advertise-client-urls=http://127.0.0.1:{cport}",
            f"--listen-peer-urls=http://127.0.0.1:{pport}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{pport}",
            f"--initial-cluster=default=http://127.0.0.1:{pport}",
            "--log-level=error",
            "--logger=zap",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{cport}", data


async def etcd_ready(store: Any) -> Any:
    """The store once the freshly spawned etcd answers (up to ~10 s)."""
    for _ in range(100):
        try:
            await store.current_revision(timeout=0.5)
            break
        except Exception:  # noqa: BLE001 - etcd still starting
            await asyncio.sleep(0.1)
    return store


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


def _register_client_proc(address: str, requests_path: str, concurrency: int, out: Any) -> None:
    """Registrations from their own process (requests read from a file); every one must be acknowledged."""

    with open(requests_path, "rb") as f:
        reqs = [registry_pb2.RegisterEntryRequest.FromString(raw) for raw in pickle.load(f)]

    async def run() -> tuple[float, list[float]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            return await timed_concurrent(len(reqs), concurrency, lambda i: stub.RegisterEntry(reqs[i]))

    rate, lat = asyncio.run(run())
    out.put((rate, lat))


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def in_processes(target: Callable[..., None], args_per_proc: list[tuple[Any, ...]]) -> tuple[float, list[float]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=target, args=(*a, queue)) for a in args_per_proc]
    for w in workers:
        w.start()
    results = [await asyncio.to_thread(queue.get) for _ in workers]
    for w in workers:
        w.join()
    return sum(r for r, _ in results), [x for _, lat in results for x in lat]


async def grpc_lookups_from_processes(
    address: str, req: registry_pb2.LookupEntryRequest, n: int, procs: int, concurrency: int = 32
) -> tuple[float, list[float]]:
    raw = req.SerializeToString()
    return await in_processes(_client_proc, [(address, raw, n // procs, concurrency)] * procs)


async def put_lease(
    store: Store, keys: KeyLayout, kind: lease_pb2.LeaseKind.ValueType, conv: str = "", engine: str = "d0"
) -> int:
    lease_id = int.from_bytes(os.urandom(7), "big") + 1
    rec = lease_pb2.Lease(
        lease_id=lease_id,
        kind=kind,
        tenant="" if kind == lease_pb2.LEASE_KIND_NODE else "acme",
        engine_id=engine,
        model=MODEL if kind == lease_pb2.LEASE_KIND_ENTRY else "",
        conversation_key=conv,
    )
    await store.put(keys.lease(lease_id), rec.SerializeToString())
    return lease_id


def entry_request(tokens: list[int], conv: str, lease_id: int, epoch: int = 1) -> registry_pb2.RegisterEntryRequest:
    n = -(-len(tokens) // BLOCK)
    return registry_pb2.RegisterEntryRequest(
        request_id=uuid.uuid4().hex,
        entry=registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv),
            engine_id="d0",
            engine_request_id=f"r-{conv}",
            block_ids=[types_pb2.BlockIds(ids=list(range(n)))],
            block_size=BLOCK,
            token_count=len(tokens),
            block_hashes=chain(tokens),
            lease_id=lease_id,
            epoch=epoch,
        ),
    )


def make_app(store: Store, keys: KeyLayout, batching: str) -> RegistryApp:
    settings = RegistrySettings(port=0, max_entries_per_tenant=1_000_000, register_batching=batching)  # type: ignore[arg-type]
    return RegistryApp(
        store,
        settings=settings,
        server_settings=ServerSettings(shutdown_grace_s=0, max_concurrent_rpcs=4096),
        keys=keys,
        releaser=NoRelease(),
    )


async def register_engine(app: RegistryApp, store: Store, keys: KeyLayout) -> None:
    async with grpc.aio.insecure_channel(app.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        node = await put_lease(store, keys, lease_pb2.LEASE_KIND_NODE)
        await stub.RegisterEngine(
            registry_pb2.RegisterEngineRequest(
                engine=types_pb2.Engine(
                    engine_id="d0",
                    role=types_pb2.ENGINE_ROLE_DECODE,
                    model=MODEL,
                    kv_host="10.0.0.1",
                    kv_port=5600,
                    block_size=BLOCK,
                    kv_group_count=1,
                    node_lease_id=node,
                )
            )
        )


async def registrations(
    app: RegistryApp, store: Store, keys: KeyLayout, args: argparse.Namespace, tag: str, store_pid: int | None
) -> dict[str, Any]:
    """args.registrations new 8K-token conversations from a client process, args.reg_concurrency in flight."""
    history = tokens_for(8192)
    n = args.registrations
    leases = [await put_lease(store, keys, lease_pb2.LEASE_KIND_ENTRY, f"{tag}-c{i}") for i in range(n)]
    raws = [entry_request(history, f"{tag}-c{i}", leases[i]).SerializeToString() for i in range(n)]
    # Through a file: pickling megabytes into the spawned client would count as server CPU.
    with tempfile.NamedTemporaryFile(prefix="bench-reg-", delete=False) as f:
        pickle.dump(raws, f)
    batcher = app.registry.batcher
    commits_before = batcher.combined_commits if batcher else 0
    load = loadavg()
    cpu0, store_cpu0 = proc_cpu_s(os.getpid()), proc_cpu_s(store_pid) if store_pid else 0.0
    try:
        rate, lat = await in_processes(_register_client_proc, [(app.address, f.name, args.reg_concurrency)])
    finally:
        os.unlink(f.name)
    cpu, store_cpu = proc_cpu_s(os.getpid()) - cpu0, (proc_cpu_s(store_pid) - store_cpu0) if store_pid else 0.0
    stored, _ = await store.range_prefix(keys.entries_prefix("acme", MODEL), keys_only=True)
    # Every acknowledged registration is in the store.
    assert sum(keys.parse_entry(kv.key)[2].startswith(f"{tag}-c") for kv in stored) == n
    return {
        "rate": rate,
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "server_us": cpu / n * 1e6,
        "store_us": store_cpu / n * 1e6,
        "combined_txns": (batcher.combined_commits - commits_before) if batcher else 0,
        "load": load,
    }


async def grpc_lookups(
    app: RegistryApp, req: registry_pb2.LookupEntryRequest, args: argparse.Namespace, procs: int
) -> dict[str, Any]:
    await grpc_lookups_from_processes(app.address, req, 200 * procs, procs)  # warm up
    load = loadavg()
    cpu0 = proc_cpu_s(os.getpid())
    rate, lat = await grpc_lookups_from_processes(app.address, req, args.lookups, procs, args.lookup_concurrency)
    cpu = proc_cpu_s(os.getpid()) - cpu0
    return {
        "rate": rate,
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "server_us": cpu / args.lookups * 1e6,
        "load": load,
    }


async def run_backend(
    name: str, store: Store, args: argparse.Namespace, store_pid: int | None = None
) -> dict[str, Any]:
    keys = KeyLayout()
    out: dict[str, Any] = {"backend": name, "reg": {}, "grpc": {}}
    app: RegistryApp | None = None
    try:
        for batching in ("off", "on"):
            if app is not None:
                await app.stop(0)
            app = make_app(store, keys, batching)
            await app.start()
            await register_engine(app, store, keys)
            out["reg"][batching] = await registrations(app, store, keys, args, batching, store_pid)
        assert app is not None
        history = tokens_for(8192)
        prompt = chain([*history, *tokens_for(200, 3)])
        keyed = registry_pb2.LookupEntryRequest(
            tenant="acme", model=MODEL, conversation_key="on-c1", block_hashes=prompt, block_size=BLOCK
        )
        packed = registry_pb2.LookupEntryRequest(
            tenant="acme", model=MODEL, conversation_key="on-c1", block_hashes_packed=b"".join(prompt), block_size=BLOCK
        )
        for form, req in (("repeated", keyed), ("packed", packed)):
            for procs in args.client_procs:
                out["grpc"][(form, procs)] = await grpc_lookups(app, req, args, procs)
        from kvbridge_services.common.auth import DEV_PRINCIPAL

        for form, req in (("repeated", keyed), ("packed", packed)):
            lat = []
            t0 = time.perf_counter()
            for _ in range(args.lookups):
                t = time.perf_counter()
                resp = app.registry.lookups.lookup(DEV_PRINCIPAL, req)
                lat.append(time.perf_counter() - t)
            assert resp.verdict == registry_pb2.LOOKUP_VERDICT_HIT
            out[f"core_{form}"] = (args.lookups / (time.perf_counter() - t0), pct(lat, 0.5), pct(lat, 0.99))
        content = registry_pb2.LookupEntryRequest(
            tenant="acme", model=MODEL, block_hashes_packed=b"".join(prompt), block_size=BLOCK
        )
        t0 = time.perf_counter()
        for _ in range(args.lookups // 4):
            resp = app.registry.lookups.lookup(DEV_PRINCIPAL, content)
        out["content_lookup_rate"] = (args.lookups // 4) / (time.perf_counter() - t0)
        assert resp.verdict == registry_pb2.LOOKUP_VERDICT_HIT
    finally:
        if app is not None:
            await app.stop(0)
    return out


def entry_sizes(stride: int = 4, tail_blocks: int = 0) -> list[tuple[int, int, int, int]]:
    """(tokens, bytes of the full chain, bytes of the stored Entry value, bytes in the in-memory index),
    the entry compacted as the registry stores it (``write_record``) with this stride and exact tail."""
    from kvbridge_services.common.hashrecord import HashRecord
    from kvbridge_services.registry.records import write_record

    rows = []
    for n_tokens in (2048, 8192, 24576):
        req = entry_request(tokens_for(n_tokens), "conv-000001", 12345678901, 3)
        rec = HashRecord.from_chain(list(req.entry.block_hashes), stride, tail_blocks)
        stored = registry_pb2.Entry()
        stored.CopyFrom(req.entry)
        write_record(stored, rec)
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


def report_sizes() -> None:
    """Bytes per entry, checkpoints only (stride 4, the earlier default) and with the registry's defaults."""
    defaults = RegistrySettings()
    print(
        "| tokens (block 16) | stored as | full chain bytes | stored Entry bytes (etcd value) "
        "| in-memory index bytes/entry |"
    )
    print("|---|---|---|---|---|")
    for stride, tail in ((4, 0), (defaults.chain_stride, defaults.chain_exact_tail_blocks)):
        label = f"stride {stride}, tail {tail} blocks"
        for n, full, stored, mem in entry_sizes(stride, tail):
            print(f"| {n} | {label} | {full} | {stored} | {mem} |")


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("Registrations (new 8K-token conversations, client in its own process):\n")
    print(
        "| backend | group commit | registrations/s | p50 ms | p99 ms | server CPU µs/reg | etcd CPU µs/reg "
        "| combined write txns | loadavg (1/5/15 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for mode, x in r["reg"].items():
            print(
                f"| {r['backend']} | {mode} | {x['rate']:.0f} | {x['p50']:.1f} | {x['p99']:.1f} "
                f"| {x['server_us']:.0f} | {x['store_us']:.0f} | {x['combined_txns']} | {x['load']} |"
            )
    print(
        "\nLookups over gRPC (keyed, 8,392-token prompt, 524 hashes; clients in their own processes, "
        f"{args.lookup_concurrency} in flight each):\n"
    )
    print(
        "| backend | hash form | client procs | lookups/s | p50 ms | p99 ms | server CPU µs/lookup "
        "| = lookups/s per server core | loadavg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for (form, procs), x in r["grpc"].items():
            print(
                f"| {r['backend']} | {form} | {procs} | {x['rate']:.0f} | {x['p50']:.1f} | {x['p99']:.1f} "
                f"| {x['server_us']:.0f} | {1e6 / x['server_us']:.0f} | {x['load']} |"
            )
    print("\nLookups in-process on the registry core (no gRPC):\n")
    print(
        "| backend | keyed lookups/s (repeated) | p50 ms | p99 ms | keyed lookups/s (packed) | p50 ms | p99 ms "
        "| content lookups/s (packed) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        (rr, r50, r99), (pr, p50, p99) = r["core_repeated"], r["core_packed"]
        print(
            f"| {r['backend']} | {rr:.0f} | {r50:.3f} | {r99:.3f} | {pr:.0f} | {p50:.3f} | {p99:.3f} "
            f"| {r['content_lookup_rate']:.0f} |"
        )
    print()
    report_sizes()


def plot(results: list[dict[str, Any]], path: str, serve_rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if serve_rows else 2, figsize=(16 if serve_rows else 11, 4.2))
    ax_reg, ax_look = axes[0], axes[1]
    names = [r["backend"].split(" (")[0] for r in results]
    xs = range(len(results))
    for offset, mode, label in ((-0.2, "off", "one txn pair per registration"), (0.2, "on", "group commit")):
        ax_reg.bar([x + offset for x in xs], [r["reg"][mode]["rate"] for r in results], 0.4, label=label)
    ax_reg.axhline(1000, color="k", linestyle="--", linewidth=1, label="target (etcd)")
    ax_reg.set_xticks(list(xs), names)
    ax_reg.set_title("registrations/s")
    ax_reg.legend(fontsize=8)
    procs = max(p for r in results for (_, p) in r["grpc"])
    for offset, form in ((-0.2, "repeated"), (0.2, "packed")):
        ax_look.bar(
            [x + offset for x in xs],
            [1e6 / r["grpc"][(form, procs)]["server_us"] for r in results],
            0.4,
            label=f"{form} hashes: per server core",
        )
    for offset, form in ((-0.2, "repeated"), (0.2, "packed")):
        ax_look.scatter(
            [x + offset for x in xs],
            [r["grpc"][(form, procs)]["rate"] for r in results],
            color="k",
            marker="x",
            zorder=3,
            label="measured, shared 2-core VM" if form == "packed" else None,
        )
    ax_look.axhline(5000, color="k", linestyle="--", linewidth=1, label="target per replica")
    ax_look.set_xticks(list(xs), names)
    ax_look.set_title(f"gRPC lookups/s ({procs} Python client procs)")
    ax_look.legend(fontsize=8)
    if serve_rows:
        ax_serve = axes[2]
        counts = sorted({x["processes"] for x in serve_rows})
        for i, n in enumerate(counts):
            rows = [x for x in serve_rows if x["processes"] == n]
            ax_serve.bar(
                [i - 0.2],
                [max(x["rate"] for x in rows)],
                0.4,
                color="C0",
                label="measured (h2load, best round)" if i == 0 else None,
            )
            ax_serve.bar(
                [i + 0.2],
                [min(1e6 / x["server_us"] for x in rows) * n],
                0.4,
                color="C2",
                label="n x per-core capacity (worst round)" if i == 0 else None,
            )
        ax_serve.axhline(5000, color="k", linestyle="--", linewidth=1, label="target per replica")
        ax_serve.set_xticks(range(len(counts)), [f"{n} server process{'es' if n > 1 else ''}" for n in counts])
        ax_serve.set_title("one replica on etcd, lookups/s (2-core VM)")
        ax_serve.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------ serving capacity

H2LOAD_MISSING = "h2load not found: apt-get install -y nghttp2-client (Debian), or skip --serve-processes"


def process_tree(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(int(k) for k in kids)]


def lookup_hits(metrics_port: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvbridge_registry_lookups_total" and sample.labels.get("verdict") == "hit"
    )


def grpc_frame(message: bytes) -> bytes:
    """One length-prefixed gRPC message (uncompressed), the body h2load sends with every request."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def run_h2load(binary: str, url: str, body: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(prefix="bench-h2load-", suffix=".tsv") as log:
        done = subprocess.run(
            [
                binary,
                "-n",
                str(n),
                "-c",
                str(args.h2_connections),
                "-m",
                str(args.h2_streams),
                "-t",
                "1",
                "-d",
                body,
                "-H",
                "content-type: application/grpc",
                "-H",
                "te: trailers",
                f"--log-file={log.name}",
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        micros = sorted(int(line.split("\t")[2]) for line in Path(log.name).read_text().splitlines() if line)
    out = done.stdout
    finished = next(line for line in out.splitlines() if line.startswith("finished in"))
    succeeded = int(next(line for line in out.splitlines() if line.startswith("requests:")).split(",")[3].split()[0])
    return {
        "rate": float(finished.split(",")[1].split()[0]),
        "succeeded": succeeded,
        "p50": micros[len(micros) // 2] / 1000,
        "p99": micros[min(len(micros) - 1, int(0.99 * len(micros)))] / 1000,
    }


def start_registry(env: dict[str, str], processes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_services.registry"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for _ in range(processes):  # each server process prints its line once it serves
        while "registry listening" not in (line := proc.stdout.readline()):
            assert line, "the registry exited"
    return proc


async def serve_run(endpoint: str, processes: int, args: argparse.Namespace, h2load: str) -> dict[str, Any]:
    """One `python -m kvbridge_services.registry` with `processes` server processes, loaded by h2load."""
    from kvbridge_services.common.store.etcd import EtcdStore

    store = EtcdStore([endpoint])
    keys = KeyLayout()
    port, metrics = free_port(), consecutive_free_ports(processes)
    env = {
        **os.environ,
        "KVBRIDGE_ETCD_ENDPOINTS": endpoint,
        "KVBRIDGE_HOST": "127.0.0.1",
        "KVBRIDGE_REGISTRY_PORT": str(port),
        "KVBRIDGE_REGISTRY_METRICS_PORT": str(metrics),
        "KVBRIDGE_LOG_LEVEL": "WARNING",
        "KVBRIDGE_MAX_CONCURRENT_RPCS": "4096",
    }
    env.pop("KVBRIDGE_API_KEYS_FILE", None)
    if processes > 1:
        env["KVBRIDGE_REGISTRY_SERVE_PROCESSES"] = str(processes)
    proc = start_registry(env, processes)
    try:
        address = f"127.0.0.1:{port}"
        conv = f"serve-{processes}-{uuid.uuid4().hex[:8]}"
        history = tokens_for(8192)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            node = await put_lease(store, keys, lease_pb2.LEASE_KIND_NODE)
            await stub.RegisterEngine(
                registry_pb2.RegisterEngineRequest(
                    engine=types_pb2.Engine(
                        engine_id="d0",
                        role=types_pb2.ENGINE_ROLE_DECODE,
                        model=MODEL,
                        kv_host="10.0.0.1",
                        kv_port=5600,
                        block_size=BLOCK,
                        kv_group_count=1,
                        node_lease_id=node,
                    )
                )
            )
            lease = await put_lease(store, keys, lease_pb2.LEASE_KIND_ENTRY, conv)
            await stub.RegisterEntry(entry_request(history, conv, lease))
        req = registry_pb2.LookupEntryRequest(
            tenant="acme",
            model=MODEL,
            conversation_key=conv,
            block_size=BLOCK,
            block_hashes_packed=b"".join(chain([*history, *tokens_for(200, 3)])),
        )
        await asyncio.sleep(1.0)  # every process's index has the entry (watch lag is milliseconds)
        url = f"http://{address}/kvbridge.registry.v1.RegistryService/LookupEntry"
        with tempfile.NamedTemporaryFile(prefix="bench-body-", suffix=".bin") as body:
            body.write(grpc_frame(req.SerializeToString()))
            body.flush()
            ports = [metrics + i for i in range(processes)]
            hits0 = sum(await asyncio.to_thread(lambda: [lookup_hits(p) for p in ports]))
            await asyncio.to_thread(run_h2load, h2load, url, body.name, 2000, args)  # warm up
            pids = process_tree(proc.pid)
            load = loadavg()
            cpu0 = sum(proc_cpu_s(p) for p in pids)
            result = await asyncio.to_thread(run_h2load, h2load, url, body.name, args.lookups, args)
            cpu = sum(proc_cpu_s(p) for p in pids) - cpu0
            hits = sum(await asyncio.to_thread(lambda: [lookup_hits(p) for p in ports])) - hits0
        # h2load sees HTTP 200 even for a gRPC error (the status is in the trailers): the hit counters say
        # every request was answered with a hit.
        assert result["succeeded"] == args.lookups and hits == args.lookups + 2000, (result, hits)
        return {**result, "server_us": cpu / args.lookups * 1e6, "load": load, "processes": processes}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        await store.close()


async def serve_capacity(args: argparse.Namespace) -> list[dict[str, Any]]:
    h2load = shutil.which("h2load")
    if h2load is None:
        raise SystemExit(H2LOAD_MISSING)
    proc, endpoint, data = spawn_etcd(args.etcd_bin)
    try:
        from kvbridge_services.common.store.etcd import EtcdStore

        probe = await etcd_ready(EtcdStore([endpoint]))
        await probe.close()
        rows = []
        for _ in range(args.serve_rounds):
            for processes in args.serve_processes:
                rows.append(await serve_run(endpoint, processes, args, h2load))
        return rows
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def report_serve(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        "\nServing capacity: `python -m kvbridge_services.registry` on etcd, keyed lookups (8,392-token prompt, "
        f"packed), h2load with {args.h2_connections} connections x {args.h2_streams} streams:\n"
    )
    print(
        "| server processes | lookups/s | p50 ms | p99 ms | server CPU µs/lookup (all processes) "
        "| = lookups/s per server core | loadavg |"
    )
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['processes']} | {x['rate']:.0f} | {x['p50']:.1f} | {x['p99']:.1f} | {x['server_us']:.0f} "
            f"| {1e6 / x['server_us']:.0f} | {x['load']} |"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--etcd-bin", default=shutil.which("etcd") or "/usr/bin/etcd")
    parser.add_argument("--registrations", type=int, default=2000)
    parser.add_argument("--reg-concurrency", type=int, default=64, help="registrations in flight")
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument(
        "--client-procs",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2],
        help="comma-separated numbers of load-generating client processes to try",
    )
    parser.add_argument("--lookup-concurrency", type=int, default=32, help="lookups in flight per client process")
    parser.add_argument("--plot", default="", help="write a PNG of registrations/s and lookups/s here")
    parser.add_argument(
        "--serve-processes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="also measure the real server process with these numbers of server processes (h2load)",
    )
    parser.add_argument("--serve-only", action="store_true", help="only the serving-capacity runs")
    parser.add_argument("--serve-rounds", type=int, default=1, help="repeat the serving-capacity runs")
    parser.add_argument("--h2-connections", type=int, default=32, help="h2load connections (spread over the processes)")
    parser.add_argument("--h2-streams", type=int, default=2, help="requests in flight per h2load connection")
    parser.add_argument("--sizes-only", action="store_true", help="only the bytes-per-entry table")
    args = parser.parse_args()
    if args.sizes_only:
        report_sizes()
        return
    serve_rows = await serve_capacity(args) if args.serve_processes else []
    if args.serve_only:
        report_serve(serve_rows, args)
        return
    results = [await run_backend("embedded (MemoryStore)", MemoryStore(), args)]
    proc, endpoint, data = spawn_etcd(args.etcd_bin)
    try:
        from kvbridge_services.common.store.etcd import EtcdStore

        store = await etcd_ready(EtcdStore([endpoint]))
        results.append(await run_backend("etcd 3.4 (1 member, local disk)", store, args, proc.pid))
        await store.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
    report(results, args)
    if serve_rows:
        report_serve(serve_rows, args)
    if args.plot:
        plot(results, args.plot, serve_rows)


if __name__ == "__main__":
    asyncio.run(main())
