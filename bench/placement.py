"""Placement at 4P4D on engine simulators: KV bytes moved per turn and TTFT, placement off (today) vs on.

    .venv/bin/python bench/placement.py --out bench/results/placement

Eight simulator processes (``tests/tools/engine_sim.py``: 4 prefill, 4 decode) model vLLM's prefix cache, a
prefill cost per token, a pull cost (KV bytes per token over a link bandwidth) and one compute unit per engine
(prefills queue; a decode step waits for the prefill running on its engine, so a D's local prefill delays its
decodes). The registry, lease manager and gateway run in this process (compatibility mode: the gateway registers
each engine and each turn). ``--conversations`` agent conversations run at once, ``--turns`` turns each; turn 1
is a ~``--first-tokens`` prompt, every later turn adds the previous answer and ``--turn-tokens`` of tool output.
Each mode runs on fresh engines and a fresh control plane:

* ``off``: today's routing (least-loaded D; P pulls the verified history from D when it is >= 64 tokens);
* ``on``: the placement cost model (D = the holder; recompute, pull to P, or a local prefill on the holder);
* ``on-no-local``: placement with ``placement_local_prefill=false`` (route to the holder, P always in the path).

TTFT = the decode engine's wall clock at its first generated token (``sim_timing.first_token_time``) minus the
time the client sent the turn (same host). Bytes: every engine's ``remote_pulled_bytes`` (P<-D: history pulled
to P; D<-P: prompt KV pulled to D), and per turn from the verdict header (P<-D) and D's ``sim_timing``. Every
answer is compared with the answer of a separate simulator that computes the same prompt with no reuse at all.
Writes <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tests.fixtures.common import free_port  # noqa: E402
from tests.fixtures.pd_pool import POOL_BLOCK, POOL_MODEL, running_gateway, static_engine  # noqa: E402

MODES: dict[str, dict[str, object]] = {
    "off": {"placement": False},
    "on": {"placement": True},
    "on-no-local": {"placement": True, "placement_local_prefill": False},
}
MIB = 1024 * 1024


@dataclass(frozen=True)
class SimSpec:
    prefill_us: float
    decode_us: float
    kv_bytes_per_token: int
    pull_bytes_per_s: float

    def args(self) -> list[str]:
        return [
            "--prefix-caching",
            "--serialize-compute",
            "--report-timing",
            "--prefill-us-per-token",
            str(self.prefill_us),
            "--decode-us-per-token",
            str(self.decode_us),
            "--kv-bytes-per-token",
            str(self.kv_bytes_per_token),
            "--pull-bytes-per-s",
            str(self.pull_bytes_per_s),
        ]


@dataclass
class Sim:
    role: str
    engine_id: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def spawn(n_prefill: int, n_decode: int, spec: SimSpec) -> list[Sim]:
    """The pool's simulator processes, then an oracle (no prefix cache, no delays)."""
    wanted = [("prefill", f"p{i}") for i in range(n_prefill)] + [("decode", f"d{i}") for i in range(n_decode)]
    common = ["--model", POOL_MODEL, "--block-size", str(POOL_BLOCK), "--total-blocks", "16384"]
    common += ["--max-model-len", "16384"]
    sims: list[Sim] = []
    for role, engine_id in [*wanted, ("decode", "oracle")]:
        port = free_port()
        extra = ["--report-timing"] if engine_id == "oracle" else spec.args()
        cmd = [sys.executable, "-m", "tests.tools.engine_sim", "--role", role, "--port", str(port)]
        proc = subprocess.Popen([*cmd, "--engine-id", engine_id, *common, *extra], cwd=ROOT)
        sims.append(Sim(role, engine_id, port, proc))
    return sims


def stop(sims: list[Sim]) -> None:
    for sim in sims:
        sim.proc.terminate()
    for sim in sims:
        sim.proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def simulators(n_prefill: int, n_decode: int, spec: SimSpec) -> AsyncIterator[tuple[list[Sim], Sim]]:
    """The simulators, up and answering /health; stopped on exit."""
    sims = spawn(n_prefill, n_decode, spec)
    try:
        async with httpx.AsyncClient() as c:
            for sim in sims:
                for _ in range(300):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await c.get(sim.url + "/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError(f"simulator {sim.engine_id} did not start")
        yield sims[:-1], sims[-1]
    finally:
        stop(sims)


# ---------------------------------------------------------------- the workload


def words(rng: random.Random, n: int) -> str:
    """``n`` words the simulator's tokenizer maps to exactly one token each (w<N> is token N)."""
    return " ".join(f"w{rng.randrange(10, 512)}" for _ in range(n))


@dataclass
class TurnRecord:
    turn: int
    prompt_tokens: int
    ttft_s: float
    placement: str
    equal: bool


# Per-engine counters of engine_sim's /sim/stats summed by role, per round (a round: every conversation's turn t).
COUNTERS = ("remote_pulled_bytes", "local_hit_tokens", "computed_tokens")


@dataclass
class Run:
    mode: str
    records: list[TurnRecord] = field(default_factory=list)
    # Per turn index: "<role>:<counter>" -> its increase over that round, summed over the repeats.
    rounds: list[dict[str, int]] = field(default_factory=list)
    wall_s: float = 0.0
    learned: list[str] = field(default_factory=list)  # the gateway's measured figures at the end of each repeat

    def total(self, key: str) -> int:
        return sum(r[key] for r in self.rounds)


@dataclass
class Conversation:
    index: int
    rng: random.Random
    messages: list[dict[str, str]]


async def reference(c: httpx.AsyncClient, oracle: Sim, messages: list[dict[str, str]], max_tokens: int) -> str:
    body = {"model": POOL_MODEL, "messages": messages, "max_tokens": max_tokens}
    r = await c.post(oracle.url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


async def one_turn(
    run: Run,
    client: httpx.AsyncClient,
    plain: httpx.AsyncClient,
    oracle: Sim,
    args: argparse.Namespace,
    conv: Conversation,
    t: int,
) -> None:
    await asyncio.sleep(conv.rng.uniform(0, args.think_s))  # the agent's tool time (staggers the round)
    body = {"model": POOL_MODEL, "messages": conv.messages, "max_tokens": args.output_tokens}
    body["conversation_id"] = f"agent-{conv.index}"
    sent = time.time()
    r = await client.post("/v1/chat/completions", json=body)
    done = time.time()
    if r.status_code != 200:
        raise RuntimeError(f"turn {t} of conversation {conv.index}: HTTP {r.status_code} {r.text}")
    data = r.json()
    answer = str(data["choices"][0]["message"]["content"])
    first = (data.get("sim_timing") or {}).get("first_token_time") or done
    run.records.append(
        TurnRecord(
            turn=t,
            prompt_tokens=int(data["usage"]["prompt_tokens"]),
            ttft_s=float(first) - sent,
            placement=r.headers.get("x-kvbridge-placement", ""),
            equal=answer == await reference(plain, oracle, conv.messages, args.output_tokens),
        )
    )
    conv.messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": words(conv.rng, args.turn_tokens)},
    ]


async def counters(c: httpx.AsyncClient, sims: list[Sim]) -> dict[str, int]:
    out: dict[str, int] = {}
    for sim in sims:
        stats = (await c.get(sim.url + "/sim/stats")).json()
        for name in COUNTERS:
            key = f"{sim.role}:{name}"
            out[key] = out.get(key, 0) + int(stats[name])
    return out


async def run_mode(run: Run, args: argparse.Namespace, spec: SimSpec) -> None:
    """One repeat of ``run.mode`` on fresh engines and a fresh control plane, added to ``run``."""
    mode = run.mode
    print(f"mode {mode}: starting {args.prefills}P{args.decodes}D simulators and the control plane", flush=True)
    async with simulators(args.prefills, args.decodes, spec) as (sims, oracle):
        engines = [static_engine(s.url, s.engine_id, s.port) for s in sims]
        gateway = {**MODES[mode], "placement_kv_bytes_per_token": spec.kv_bytes_per_token}
        prefill = [e for e in engines if e.engine_id.startswith("p")]
        decode = [e for e in engines if e.engine_id.startswith("d")]
        convs = []
        for i in range(args.conversations):
            rng = random.Random(f"{args.seed}-{i}")
            system, task = words(rng, 100), words(rng, args.first_tokens - 100)
            convs.append(
                Conversation(i, rng, [{"role": "system", "content": system}, {"role": "user", "content": task}])
            )
        # No keep-alive: a connection idle past the server's keep-alive closes under a request that reuses it.
        once = httpx.Limits(max_keepalive_connections=0)
        async with (
            running_gateway(prefill, decode, gateway) as (app, tenant),
            httpx.AsyncClient(base_url=tenant.base_url, headers=tenant.headers, timeout=120, limits=once) as client,
            httpx.AsyncClient(timeout=120, limits=once) as plain,
        ):
            await asyncio.sleep(1.0)  # first health checks
            started = time.monotonic()
            for t in range(1, args.turns + 1):
                before = await counters(plain, sims)
                await asyncio.gather(*(one_turn(run, client, plain, oracle, args, c, t) for c in convs))
                await app.core.router.drain()
                after = await counters(plain, sims)
                rd = {k: after[k] - before[k] for k in after}
                if len(run.rounds) < t:
                    run.rounds.append(dict.fromkeys(rd, 0))
                run.rounds[t - 1] = {k: run.rounds[t - 1][k] + v for k, v in rd.items()}
                ttfts = sorted(r.ttft_s for r in run.records if r.turn == t)
                moved = (rd["prefill:remote_pulled_bytes"] + rd["decode:remote_pulled_bytes"]) / MIB
                print(
                    f"  [{mode}] turn {t}/{args.turns}: {len(ttfts)} conversations, "
                    f"{time.monotonic() - started:.0f} s, TTFT p50 {1000 * ttfts[len(ttfts) // 2]:.0f} ms, "
                    f"moved {moved:.0f} MiB",
                    flush=True,
                )
            run.wall_s += time.monotonic() - started
            figures = app.core.router.figures
            fits = [figures.prefill(e.engine_id) for e in prefill]
            bw = figures.measured_bytes_per_s
            run.learned.append(
                f"P prefill {1e6 * statistics.mean(f.s_per_token for f in fits):.0f} us/token + "
                f"{1000 * statistics.mean(f.fixed_s for f in fits):.0f} ms per call "
                f"({sum(f.line for f in fits)}/{len(fits)} fitted lines), pull "
                + (f"{bw / 1e9:.1f} GB/s measured" if bw else "not measured (default 10 GB/s)")
            )


# ---------------------------------------------------------------- results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float], q: float) -> str:
    return f"{1000 * pct(values, q):.0f}"


def summary_rows(runs: list[Run]) -> list[str]:
    rows = [
        "| mode | turns | answers equal | TTFT p50 (ms) | TTFT p99 (ms) | p50, turns 2+ | p99, turns 2+ "
        "| P<-D MiB/turn | D<-P MiB/turn | moved MiB/turn | prefilled tok/turn | choices (turns 2+) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in runs:
        recs, later = run.records, [r for r in run.records if r.turn >= 2]
        n = len(recs)
        p_mib, d_mib = (
            run.total("prefill:remote_pulled_bytes") / n / MIB,
            run.total("decode:remote_pulled_bytes") / n / MIB,
        )
        computed = (run.total("prefill:computed_tokens") + run.total("decode:computed_tokens")) / n
        choices = Counter(r.placement.split(";")[0] or "(off)" for r in later)
        rows.append(
            f"| {run.mode} | {n} | {sum(r.equal for r in recs)}/{n} "
            f"| {ms([r.ttft_s for r in recs], 0.5)} | {ms([r.ttft_s for r in recs], 0.99)} "
            f"| {ms([r.ttft_s for r in later], 0.5)} | {ms([r.ttft_s for r in later], 0.99)} "
            f"| {p_mib:.1f} | {d_mib:.1f} | {p_mib + d_mib:.1f} | {computed:.0f} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(choices.items()))} |"
        )
    return rows


def by_turn_rows(runs: list[Run], conversations: int) -> list[str]:
    """``conversations``: turns per turn index (conversations x repeats)."""
    head, sep = "| turn | context (tok) |", "| ---: | ---: |"
    for run in runs:
        head += f" {run.mode}: TTFT p50 / p99 (ms) | P<-D / D<-P MiB per turn | P / D local hits (tok) |"
        sep += " ---: | ---: | ---: |"
    rows = [head, sep]
    for t, _ in enumerate(runs[0].rounds, start=1):
        ctx = statistics.mean(r.prompt_tokens for r in runs[0].records if r.turn == t)
        line = f"| {t} | {ctx:.0f} |"
        for run in runs:
            ttfts = [r.ttft_s for r in run.records if r.turn == t]
            rd = run.rounds[t - 1]
            line += (
                f" {ms(ttfts, 0.5)} / {ms(ttfts, 0.99)} "
                f"| {rd['prefill:remote_pulled_bytes'] / conversations / MIB:.1f} / "
                f"{rd['decode:remote_pulled_bytes'] / conversations / MIB:.1f} "
                f"| {rd['prefill:local_hit_tokens'] // conversations} / "
                f"{rd['decode:local_hit_tokens'] // conversations} |"
            )
        rows.append(line)
    return rows


def plot(runs: list[Run], conversations: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = list(range(1, len(runs[0].rounds) + 1))
    for run in runs:
        p50 = [1000 * pct([r.ttft_s for r in run.records if r.turn == t], 0.5) for t in xs]
        p99 = [1000 * pct([r.ttft_s for r in run.records if r.turn == t], 0.99) for t in xs]
        (line,) = ax1.plot(xs, p50, marker="o", label=f"{run.mode} p50")
        ax1.plot(xs, p99, linestyle="--", color=line.get_color(), label=f"{run.mode} p99")
        moved = [
            (rd["prefill:remote_pulled_bytes"] + rd["decode:remote_pulled_bytes"]) / conversations / MIB
            for rd in run.rounds
        ]
        ax2.plot(xs, moved, marker="o", color=line.get_color(), label=run.mode)
    ax1.set(xlabel="turn", ylabel="TTFT (ms)", title="TTFT by turn (4P4D simulators)")
    ax2.set(xlabel="turn", ylabel="KV moved per turn (MiB)", title="P<-D + D<-P bytes per turn")
    ax1.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(
    runs: list[Run], args: argparse.Namespace, spec: SimSpec, out: Path, elapsed_s: float, load: str
) -> None:
    command = " ".join([".venv/bin/python bench/placement.py", *sys.argv[1:]])
    per_token_pull_us = 1e6 * spec.kv_bytes_per_token / spec.pull_bytes_per_s
    lines = [
        "# Placement: route to the holder, and a cost model per turn (4P4D simulators)",
        "",
        f"Command: `{command}`",
        "",
        f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed_s / 60:.1f} min. Machine: 2 CPU cores "
        f"shared with other work (load average {load}), no GPU; simulators as separate processes, control plane and "
        "gateway in the bench process (compatibility mode: the gateway registers each engine and each turn).",
        "",
        f"Simulators (`tests/tools/engine_sim.py`): {args.prefills} prefill + {args.decodes} decode, prefix caching "
        f"on, one compute unit each (prefills queue, decode steps wait for a running prefill), prefill "
        f"{spec.prefill_us:.0f} us/token, decode {spec.decode_us / 1000:.1f} ms/token, KV "
        f"{spec.kv_bytes_per_token // 1024} KiB/token, pull {spec.pull_bytes_per_s / 1e9:.1f} GB/s (a token's KV "
        f"pulls in {per_token_pull_us:.0f} us, {spec.prefill_us / per_token_pull_us:.1f}x faster than it prefills). "
        f"Workload: {args.conversations} agent conversations, {args.turns} turns each, in rounds (every conversation's "
        f"turn t, each after 0..{args.think_s} s of tool time); a ~{args.first_tokens}-token first prompt, then each "
        f"turn adds the {args.output_tokens}-token answer and {args.turn_tokens} tokens of tool output; every mode "
        f"{args.repeats} times, in alternating order, each on fresh engines and a fresh control plane. Gateway: "
        "placement figures from their defaults (measured as the run goes), `placement_kv_bytes_per_token` as the "
        "simulators'. Modes: `off` (today: least-loaded D, fixed 64-token threshold), `on` (placement), "
        "`on-no-local` (placement without the local prefill: route to the holder, P always in the path).",
        "",
        "What each gateway had measured at the end of a run (its estimates' inputs): "
        + "; ".join(f"`{run.mode}`: " + " / ".join(run.learned) for run in runs if run.mode != "off")
        + ".",
        "",
        "TTFT: D's clock at its first generated token minus the client's send time. Bytes: every engine's pulled "
        "bytes (P<-D: history pulled to P; D<-P: prompt KV pulled to D) / turns. Prefilled: prompt tokens computed "
        "on any engine / turns (neither cached nor pulled).",
        "",
        *summary_rows(runs),
        "",
        "By turn (per conversation):",
        "",
        *by_turn_rows(runs, args.conversations * args.repeats),
        "",
        f"![TTFT and bytes by turn]({out.with_suffix('.png').name})",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "placement")
    parser.add_argument("--modes", default="off,on,on-no-local")
    parser.add_argument("--prefills", type=int, default=4)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=1000)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.5)
    parser.add_argument("--prefill-us", type=float, default=300.0)
    parser.add_argument("--decode-us", type=float, default=8000.0)
    parser.add_argument("--kv-bytes-per-token", type=int, default=128 * 1024)
    parser.add_argument("--pull-gbps", type=float, default=5.0, help="pull bandwidth, GB/s")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every mode, in alternating order")
    args = parser.parse_args()
    spec = SimSpec(args.prefill_us, args.decode_us, args.kv_bytes_per_token, args.pull_gbps * 1e9)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    modes = args.modes.split(",")
    by_mode = {mode: Run(mode) for mode in modes}
    for repeat in range(args.repeats):  # the order alternates, so drift in the host's load hits every mode alike
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            print(f"repeat {repeat + 1}/{args.repeats}", end=", ", flush=True)
            await run_mode(by_mode[mode], args, spec)
    runs = list(by_mode.values())
    load = f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    print("\n".join(summary_rows(runs)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.conversations * args.repeats, args.out.with_suffix(".png"))
    write_report(runs, args, spec, args.out, time.monotonic() - started, load)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


def _quiet_logs() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)


if __name__ == "__main__":
    _quiet_logs()
    asyncio.run(main())
