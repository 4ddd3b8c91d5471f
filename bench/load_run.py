"""Load run: N concurrent multi-turn conversations through gateway + registry + lease manager on etcd.

    .venv/bin/python bench/load_run.py --conversations 1000 --duration 180 --think-s 10 \
        --client-procs 1 --sim-procs --out bench/results/load_1000_think10

Registry and lease manager run as their own processes on a single-member etcd (tests/fixtures); the
gateway runs in this process; the engine simulators (tests/tools/engine_sim.py, a test tool, not vLLM:
latency modelled from token counts) run here too, or each in its own process (--sim-procs); the clients run
here, or in --client-procs processes. Each client runs a conversation for --turns turns, then starts a new
one (bounded prompts; the registry sees a steady stream of new keys). Writes <out>.md (figures, per-turn
latency percentiles, reuse rate, load average) and <out>.png (latency over time; p50/p99 per turn).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.queues
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.* helpers

from tests.fixtures.control_plane_procs import run_control_plane
from tests.tools.engine_sim import SimConfig, SimServer

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine

MODEL, BLOCK, SECRET_HEX = "sim-model", 16, "00112233445566778899aabbccddeeff"


@dataclass
class Sample:
    t: float  # seconds since start
    latency_s: float
    ok: bool
    verdict: str
    turn: int = 0  # 0-based turn index within its conversation


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    overhead_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    state: list[tuple[float, int, int]] = field(default_factory=list)  # (t, entries, leases)
    loadavg: list[tuple[float, str]] = field(default_factory=list)  # (t, /proc/loadavg 1/5/15 min)


class _Recorder:
    """Stands in for the router-overhead histogram to keep every observation (exact percentiles)."""

    def __init__(self, inner: Any, sink: list[float]) -> None:
        self._inner, self._sink = inner, sink

    def labels(self, *a: Any, **kw: Any) -> _Recorder:
        return _Recorder(self._inner.labels(*a, **kw), self._sink)

    def observe(self, value: float, *a: Any, **kw: Any) -> None:
        self._sink.append(value)
        self._inner.observe(value, *a, **kw)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def per_turn(run: Run) -> dict[int, list[float]]:
    """Latencies (ms) of successful turns by turn index."""
    out: dict[int, list[float]] = {}
    for s in run.samples:
        if s.ok:
            out.setdefault(s.turn, []).append(s.latency_s * 1e3)
    return dict(sorted(out.items()))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def client(gw: str, idx: int, args: argparse.Namespace, run: Run, t0: float, stop: asyncio.Event) -> None:
    await asyncio.sleep(args.ramp_s * idx / max(args.conversations, 1))  # staggered starts, no thundering herd
    async with httpx.AsyncClient(base_url=gw, timeout=60) as http:
        conv_n = 0
        while not stop.is_set():
            conv = f"c{idx}-{conv_n}"
            conv_n += 1
            msgs = [{"role": "user", "content": " ".join(f"w{(idx * 7 + i) % 400 + 10}" for i in range(args.prompt))}]
            for turn in range(args.turns):
                if stop.is_set():
                    return
                started = time.perf_counter()
                try:
                    r = await http.post(
                        "/v1/chat/completions",
                        json={"model": MODEL, "messages": msgs, "max_tokens": args.max_tokens, "conversation_id": conv},
                    )
                    ok = r.status_code == 200
                    verdict = r.headers.get("x-kvbridge-reuse", "").split(";")[0]
                    if ok:
                        answer = r.json()["choices"][0]["message"]["content"]
                    else:
                        run.errors[str(r.status_code)] = run.errors.get(str(r.status_code), 0) + 1
                except httpx.HTTPError as exc:
                    ok, verdict = False, ""
                    run.errors[type(exc).__name__] = run.errors.get(type(exc).__name__, 0) + 1
                run.samples.append(Sample(started - t0, time.perf_counter() - started, ok, verdict, turn))
                if not ok:
                    break
                msgs = [
                    *msgs,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"w{turn + 11} w{idx % 300 + 10} tell me more"},
                ]
                await asyncio.sleep(args.think_s)


def _worker(
    gw: str,
    indices: list[int],
    args: argparse.Namespace,
    start_wall: float,
    out: multiprocessing.queues.Queue[tuple[list[Sample], dict[str, int]]],
) -> None:
    """A client process: runs its share of the conversations for the run's duration, then reports."""

    async def body() -> Run:
        run, stop = Run(), asyncio.Event()
        t0 = time.perf_counter() - (time.time() - start_wall)  # the parent's start on this process's clock
        tasks = [asyncio.create_task(client(gw, i, args, run, t0, stop)) for i in indices]
        await asyncio.sleep(max(0.0, start_wall + args.duration - time.time()))
        stop.set()
        await asyncio.gather(*tasks)
        return run

    run = asyncio.run(body())
    out.put((run.samples, run.errors))


async def collect_workers(gw: str, args: argparse.Namespace, run: Run, t0: float) -> None:
    """Runs the clients in --client-procs processes so they do not share the gateway's event loop."""
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.queues.Queue[tuple[list[Sample], dict[str, int]]] = ctx.Queue()
    start_wall = time.time() - (time.perf_counter() - t0)
    shares = [list(range(k, args.conversations, args.client_procs)) for k in range(args.client_procs)]
    procs = [ctx.Process(target=_worker, args=(gw, share, args, start_wall, queue), daemon=True) for share in shares]
    for proc in procs:
        proc.start()
    for _ in procs:
        samples, errors = await asyncio.to_thread(queue.get, True, args.duration + 300)
        run.samples.extend(samples)
        for k, v in errors.items():
            run.errors[k] = run.errors.get(k, 0) + v
    for proc in procs:
        await asyncio.to_thread(proc.join, 30)


REPO = Path(__file__).resolve().parents[1]


def spawn_sim(cfg: SimConfig) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.tools.engine_sim",
            "--role",
            cfg.role,
            "--port",
            str(cfg.port),
            "--engine-id",
            cfg.engine_id,
            "--model",
            cfg.model,
            "--block-size",
            str(cfg.block_size),
            "--total-blocks",
            str(cfg.total_blocks),
            "--decoder-kv-blocks-ttl",
            str(cfg.decoder_kv_blocks_ttl),
            "--prefill-us-per-token",
            str(cfg.prefill_us_per_token),
            "--decode-us-per-token",
            str(cfg.decode_us_per_token),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


async def wait_healthy(cfg: SimConfig) -> None:
    async with httpx.AsyncClient() as http, asyncio.timeout(60):
        while True:
            try:
                if (await http.get(f"http://127.0.0.1:{cfg.port}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                await asyncio.sleep(0.2)


async def count_state(registry: str, lease: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(registry) as rch, grpc.aio.insecure_channel(lease) as lch:
        reg, ls = registry_pb2_grpc.RegistryServiceStub(rch), lease_pb2_grpc.LeaseServiceStub(lch)
        entries, token = 0, ""
        while True:
            resp = await reg.ListEntries(
                registry_pb2.ListEntriesRequest(tenant="default", page_size=1000, page_token=token), timeout=10
            )
            entries += len(resp.entries)
            token = resp.next_page_token
            if not token:
                break
        leases, token = 0, ""
        while True:
            lresp = await ls.ListLeases(lease_pb2.ListLeasesRequest(page_size=1000, page_token=token), timeout=10)
            leases += len(lresp.leases)
            token = lresp.next_page_token
            if not token:
                break
        return entries, leases


async def main_async(args: argparse.Namespace, registry: str, lease: str) -> Run:
    run = Run()
    sims = [
        SimServer(
            SimConfig(
                role="prefill",
                engine_id=f"p{i}",
                model=MODEL,
                block_size=BLOCK,
                total_blocks=200_000,
                prefill_us_per_token=args.prefill_us,
                decode_us_per_token=args.decode_us,
            )
        )
        for i in range(args.prefills)
    ]
    sims += [
        SimServer(
            SimConfig(
                role="decode",
                engine_id=f"d{i}",
                model=MODEL,
                block_size=BLOCK,
                total_blocks=200_000,
                decoder_kv_blocks_ttl=120,
                prefill_us_per_token=args.prefill_us,
                decode_us_per_token=args.decode_us,
            )
        )
        for i in range(args.decodes)
    ]
    if args.sim_procs:  # same configurations, each simulator in its own process (off the gateway's loop)
        sim_procs = [spawn_sim(sim.cfg) for sim in sims]
        try:
            for sim in sims:
                await wait_healthy(sim.cfg)
            return await drive(args, registry, lease, sims, run)
        finally:
            for proc in sim_procs:
                proc.terminate()
                proc.wait(timeout=10)
    for sim in sims:
        await sim.__aenter__()
    try:
        return await drive(args, registry, lease, sims, run)
    finally:
        for sim in sims:
            await sim.__aexit__(None, None, None)


async def drive(args: argparse.Namespace, registry: str, lease: str, sims: list[SimServer], run: Run) -> Run:
    """Gateway over the simulators, then the clients for the run's duration."""

    def spec(sim: SimServer) -> StaticEngine:
        return StaticEngine(
            url=sim.url,
            model=MODEL,
            engine_id=sim.cfg.engine_id,
            kv_host="127.0.0.1",
            kv_port=sim.cfg.port,
            block_size=BLOCK,
            register_in_registry=True,
        )

    settings = GatewaySettings(
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        registry_address=registry,
        lease_address=lease,
        hash_secret_hex=SECRET_HEX,
        default_block_size=BLOCK,
        reuse_threshold_tokens=64,
        entry_lease_ttl_s=args.entry_ttl,
        max_concurrency=10_000,
        max_tenant_concurrency=10_000,  # one tenant ("default") runs every conversation
        prefill_engines=[spec(s) for s in sims[: args.prefills]],
        decode_engines=[spec(s) for s in sims[args.prefills :]],
        engines_from_registry=False,
    )
    gw = GatewayApp(settings)
    gw.core.metrics.router_overhead = _Recorder(gw.core.metrics.router_overhead, run.overhead_s)  # type: ignore[assignment]
    await gw.start()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    if args.client_procs:
        tasks = [asyncio.create_task(collect_workers(gw.http_url, args, run, t0))]
    else:
        tasks = [asyncio.create_task(client(gw.http_url, i, args, run, t0, stop)) for i in range(args.conversations)]

    async def sampler() -> None:
        while not stop.is_set():
            await asyncio.sleep(max(args.duration / 6, 2))
            run.loadavg.append((time.perf_counter() - t0, loadavg()))
            try:
                e, n = await count_state(registry, lease)
                run.state.append((time.perf_counter() - t0, e, n))
            except grpc.aio.AioRpcError:
                pass

    sample_task = asyncio.create_task(sampler())
    await asyncio.sleep(args.duration)
    stop.set()
    await asyncio.gather(*tasks)
    sample_task.cancel()
    await gw.core.router.drain()
    run.state.append((time.perf_counter() - t0, *(await count_state(registry, lease))))
    try:
        await gw.stop()
    except Exception as exc:  # noqa: BLE001 - the figures are collected; a failing shutdown must not lose them
        print(f"gateway stop failed: {exc!r}", file=sys.stderr)
    return run


def report(args: argparse.Namespace, run: Run, command: str) -> str:
    ok = [s for s in run.samples if s.ok]
    lat = [s.latency_s for s in ok]
    verdicts: dict[str, int] = {}
    for s in ok:
        verdicts[s.verdict] = verdicts.get(s.verdict, 0) + 1
    later = [s for s in ok if s.turn > 0]
    hits_by_turn: dict[int, int] = {}
    for s in ok:
        hits_by_turn[s.turn] = hits_by_turn.get(s.turn, 0) + (s.verdict == "hit")
    reuse_rate = f"{sum(s.verdict == 'hit' for s in later) / len(later):.1%} of {len(later)}" if later else "n/a"
    peak_entries = max((e for _, e, _ in run.state), default=0)
    peak_leases = max((n for _, _, n in run.state), default=0)
    lines = [
        "# Load run: concurrent multi-turn conversations through the control plane",
        "",
        f"Command: `{command}`",
        "",
        "Setup: registry + lease manager as separate processes on a single-member etcd 3.4; gateway in the load "
        "process; engine simulators (test tool, not real vLLM: latency modelled from token counts) "
        + ("in their own processes" if args.sim_procs else "in the load process")
        + "; clients "
        + (f"in {args.client_procs} separate processes. " if args.client_procs else "in the load process. ")
        + f"Machine: 2 cores shared with other work. {args.prefills} prefill + {args.decodes} decode simulators, "
        f"{args.prefill_us:.0f} us/prompt token prefill, {args.decode_us:.0f} us/output token, "
        f"{args.max_tokens} output tokens, {args.turns} turns per conversation then a new conversation id, "
        f"{args.think_s:.2f} s think time, first turns spread over {args.ramp_s:.0f} s.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| concurrent conversations | {args.conversations} |",
        f"| duration | {args.duration:.0f} s |",
        f"| turns completed | {len(ok)} |",
        f"| throughput | {len(ok) / args.duration:.1f} turns/s |",
        f"| errors | {sum(run.errors.values())} {run.errors or ''} |",
        f"| end-to-end latency p50 / p99 / mean | {pct(lat, 0.5) * 1e3:.1f} / {pct(lat, 0.99) * 1e3:.1f} / "
        f"{statistics.mean(lat) * 1e3 if lat else float('nan'):.1f} ms |",
        f"| router overhead p50 / p99 | {pct(run.overhead_s, 0.5) * 1e3:.2f} / "
        f"{pct(run.overhead_s, 0.99) * 1e3:.2f} ms ({len(run.overhead_s)} turns) |",
        f"| reuse verdicts | {', '.join(f'{k}: {v}' for k, v in sorted(verdicts.items()))} |",
        f"| reuse rate (turns 2+ answered with a hit) | {reuse_rate} |",
        f"| load average (1/5/15 min) during the run | {'; '.join(f't={t:.0f}s {la}' for t, la in run.loadavg)} |",
        f"| registry entries / leases (peak of samples) | {peak_entries} / {peak_leases} |",
        f"| registry entries / leases over time | {'; '.join(f't={t:.0f}s {e}/{n}' for t, e, n in run.state)} |",
        "",
        "Router overhead: the gateway's own time per turn (kvbridge_gateway_router_overhead_seconds: tokenize, "
        "registry lookup, routing, registration), excluding engine time.",
        f"State bound: entries are capped per tenant (registry max_entries_per_tenant) and each lives on a lease "
        f"of {args.entry_ttl:.0f} s, single-use in compatibility mode; the samples above stay below the number "
        f"of conversation ids ever started.",
        "",
        "Latency per turn of a conversation (turn 1 has nothing to reuse):",
        "",
        "| turn | turns completed | p50 ms | p99 ms | hits |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {t + 1} | {len(v)} | {pct(v, 0.5):.1f} | {pct(v, 0.99):.1f} | {hits_by_turn.get(t, 0)} |"
            for t, v in per_turn(run).items()
        ),
        "",
        f"![latency over time and per turn]({Path(args.out).name}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, by_turn) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ok = [s for s in run.samples if s.ok]
    ax.scatter([s.t for s in ok], [s.latency_s * 1e3 for s in ok], s=2, alpha=0.3, label="turn latency")
    buckets: dict[int, list[float]] = {}
    for s in ok:
        buckets.setdefault(int(s.t), []).append(s.latency_s * 1e3)
    xs = sorted(buckets)
    ax.plot(xs, [pct(buckets[x], 0.5) for x in xs], color="black", label="p50 per second")
    ax.plot(xs, [pct(buckets[x], 0.99) for x in xs], color="red", label="p99 per second")
    bad = [s for s in run.samples if not s.ok]
    if bad:
        ax.scatter([s.t for s in bad], [0] * len(bad), marker="x", color="red", label="errors")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("end-to-end turn latency (ms)")
    ax.set_title("kvbridge load run: latency over time")
    ax.legend(loc="upper right")
    turns = per_turn(run)
    xs_turn = [t + 1 for t in turns]
    by_turn.plot(xs_turn, [pct(v, 0.5) for v in turns.values()], marker="o", color="black", label="p50")
    by_turn.plot(xs_turn, [pct(v, 0.99) for v in turns.values()], marker="o", color="red", label="p99")
    by_turn.set_xlabel("turn of the conversation")
    by_turn.set_ylabel("end-to-end turn latency (ms)")
    by_turn.set_title("latency percentiles per turn")
    by_turn.set_xticks(xs_turn)
    by_turn.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt", type=int, default=120, help="words in the first user message")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--prefill-us", type=float, default=20.0)
    p.add_argument("--decode-us", type=float, default=2000.0)
    p.add_argument("--entry-ttl", type=float, default=60.0)
    p.add_argument("--ramp-s", type=float, default=0.0, help="spread the clients' first turns over this long")
    p.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="run the clients in this many processes (0: in the gateway's process)",
    )
    p.add_argument("--sim-procs", action="store_true", help="run each engine simulator in its own process")
    p.add_argument("--out", default="bench/results/load")
    args = p.parse_args()
    command = "python bench/load_run.py " + " ".join(sys.argv[1:])
    os.environ["KVBRIDGE_REGISTRY_METRICS_PORT"] = "0"  # the default port may be taken on a shared machine
    with tempfile.TemporaryDirectory() as tmp, run_control_plane(Path(tmp)) as cp:
        run = asyncio.run(main_async(args, cp.registry_target, cp.lease_target))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report(args, run, command)
    out.with_suffix(".md").write_text(text)
    plot(run, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
