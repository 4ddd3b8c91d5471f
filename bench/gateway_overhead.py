"""Gateway router overhead: a turn through the gateway vs the same P/D protocol called on the engines directly.

    .venv/bin/python bench/gateway_overhead.py --out bench/results/gateway

Processes: a prefill and a decode engine simulator (tests/tools/engine_sim.py, a test tool; small fixed
per-token delays so overhead dominates), the gateway in its own process and the real registry + lease
manager (embedded in-memory store) in another, as deployed (``--layout all-in-one`` runs all three in one
``kvbridge_services.stack.Stack`` process instead); gateway logging at its default INFO level into a file;
this process is the load client.

Each client worker runs multi-turn conversations twice in lockstep with identical prompts: one through the
gateway (``conversation_id`` set, so lookups, pulls and registrations happen), one
directly: prefill on P (``max_tokens=1``, ``do_remote_decode``), then decode on D with P's returned params.
The direct path also pulls the previous turn's KV from D exactly like the gateway's hit path (an oracle
router with no control plane), so engine work is the same on both sides and the per-turn difference is what
the gateway adds. Order alternates per turn. ``--direct-mode plain`` drops the pull. ``--prompt-tokens
2048,8192,24576,65536,131072`` replaces the concurrency levels by prompt-size levels (one conversation each,
the simulators' --max-model-len raised to fit; bench/results/gateway_by_size.md). ``--engines connector`` runs
the simulators with the kvbridge connector's control plane (connector mode, the mode kvbridge ships:
D registers its own entries and holds them by reference, so the gateway neither registers nor consumes;
bench/results/gateway_connector_by_size.md); the default ``stock`` measures compatibility mode. Writes <out>.md,
<out>_overhead.png, <out>_pairs.json (every turn pair) and (with ``--profile-seconds``) <out>_profile.txt
(cProfile of the gateway process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.common import free_port  # noqa: E402

MODEL, BLOCK, SECRET_HEX = "sim-model", 16, "00112233445566778899aabbccddeeff"
REUSE_THRESHOLD = 64  # the gateway's default reuse_threshold_tokens


# ---- control-plane process (gateway + registry + lease manager) ---------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    """One bench process: ``all`` (gateway + registry + lease manager), ``control`` (registry + lease
    manager) or ``gateway`` (the gateway alone, talking gRPC to a ``control`` process)."""
    from kvbridge_services.gateway.app import GatewayApp
    from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
    from kvbridge_services.stack import Stack, StackConfig

    def engine(url: str, engine_id: str) -> StaticEngine:
        port = int(url.rsplit(":", 1)[1])
        return StaticEngine(
            url=url,
            model=MODEL,
            engine_id=engine_id,
            kv_host="127.0.0.1",
            kv_port=port,
            block_size=BLOCK,
            register_in_registry=True,
        )

    def gateway_settings(**update: Any) -> GatewaySettings:
        tokenizers = {MODEL: args.tokenizer_dir} if args.tokenizer_dir else {}
        connector = args.engines == "connector"  # the engines register themselves: none configured here
        return GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            hash_secret_hex=SECRET_HEX,
            default_block_size=BLOCK,
            engines_from_registry=connector,
            registry_refresh_s=0.5,
            tokenizers=tokenizers,
            prefill_engines=[] if connector else [engine(args.prefill_url, "p0")],
            decode_engines=[] if connector else [engine(args.decode_url, "d0")],
            **update,
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.role == "gateway":
        app = GatewayApp(gateway_settings(registry_address=args.registry, lease_address=args.lease))
        await app.start()
        ready_by = time.monotonic() + 60
        while not app.core.ready():  # connector mode: until the engines' registrations reach the gateway
            if time.monotonic() > ready_by:
                raise RuntimeError("no P and D engine registered within 60 s")
            await asyncio.sleep(0.1)
        if args.profiler is not None:  # from here on: serving, not start-up (imports, tokenizer loading)
            args.profiler.enable()
        print("READY", app.http_url, flush=True)
        await stop.wait()
        await app.stop()
        return
    gw = gateway_settings() if args.role == "all" else None
    stack = Stack(StackConfig(registry_port=0, lease_port=0, gateway=gw))
    await stack.start()
    assert stack.registry is not None and stack.lease is not None
    if stack.gateway is not None:
        if args.profiler is not None:
            args.profiler.enable()
        print("READY", stack.gateway.http_url, flush=True)
    else:
        print("READY", stack.registry.address, stack.lease.address, flush=True)
    await stop.wait()
    await stack.stop()


def serve_main(argv: list[str]) -> None:
    import logging

    p = argparse.ArgumentParser(prog="gateway_overhead.py serve")
    p.add_argument("--prefill-url", default="", help="roles all and gateway (stock engines)")
    p.add_argument("--decode-url", default="", help="roles all and gateway (stock engines)")
    p.add_argument("--engines", choices=["stock", "connector"], default="stock")
    p.add_argument("--role", choices=["all", "control", "gateway"], default="all")
    p.add_argument("--registry", default="", help="role gateway: the control process's registry address")
    p.add_argument("--lease", default="", help="role gateway: the control process's lease manager address")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--tokenizer-dir", type=Path, help="the gateway tokenizes locally with this HF tokenizer")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--profile", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prof = cProfile.Profile() if args.profile else None
    args.profiler = prof  # enabled once the process serves
    if args.uvloop:
        import uvloop

        uvloop.install()
    asyncio.run(_serve(args))
    if prof:
        prof.disable()
        prof.dump_stats(args.profile)


# ---- processes ---------------------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A child-process hook confining it to ``cpus`` (None: wherever the scheduler likes)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@dataclass
class Procs:
    tmp: Path
    prefill_url: str = ""
    decode_url: str = ""
    gateway_url: str = ""
    sims: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway: subprocess.Popen[str] | None = None
    control: subprocess.Popen[str] | None = None
    control_addresses: tuple[str, str] = ("", "")
    tokenizer_dir: Path | None = None  # the dev HF tokenizer (unless --tokenize sim)

    def build_tokenizer(self, args: argparse.Namespace) -> None:
        if args.tokenize == "sim":
            return
        from kvbridge_services.devengines.model import build_tokenizer

        self.tokenizer_dir = self.tmp / "dev-tokenizer"
        self.tokenizer_dir.mkdir(exist_ok=True)
        build_tokenizer(self.tokenizer_dir, 512)

    def start_sims(self, args: argparse.Namespace) -> None:
        """``--engines connector``: the simulators run the kvbridge connector's control plane
        (tests/tools/sim_connector.py) against the control process, which must be running."""
        kvbridge_config: dict[str, Any] = {}
        if args.engines == "connector":
            registry, lease = self.control_addresses
            kvbridge_config = {
                "kvbridge_registry": registry,
                "kvbridge_lease": lease,
                "kvbridge_hash_secret": SECRET_HEX,
                # The direct (oracle) path has no deployment secret and no tokenizer: P accepts its unsigned
                # offers without a digest or deadline. The gateway's offers still carry the prompt-prefix
                # digest, which P checks when present.
                "kvbridge_require_signed_offer": False,
                "kvbridge_require_prefix_digest": False,
                "kvbridge_require_offer_deadline": False,
            }
        for role, eid in (("prefill", "p0"), ("decode", "d0")):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "tests.tools.engine_sim",
                "--role",
                role,
                "--port",
                str(port),
                "--engine-id",
                eid,
                "--model",
                MODEL,
                "--block-size",
                str(BLOCK),
                "--total-blocks",
                "1000000",
                "--decoder-kv-blocks-ttl",
                "120",
                "--prefill-us-per-token",
                str(args.prefill_us_per_token),
                "--decode-us-per-token",
                str(args.decode_us_per_token),
                "--max-model-len",
                str(args.max_model_len),
            ]
            if self.tokenizer_dir is not None:
                cmd += ["--hf-tokenizer", str(self.tokenizer_dir)]
            if kvbridge_config:
                cmd += ["--kvbridge-config", json.dumps(kvbridge_config)]
            log = open(self.tmp / f"sim-{eid}.log", "wb")  # noqa: SIM115 - lives as long as the process
            self.sims.append(
                subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, preexec_fn=_pinned(args.other_cpus))
            )
            url = f"http://127.0.0.1:{port}"
            if role == "prefill":
                self.prefill_url = url
            else:
                self.decode_url = url
        for url in (self.prefill_url, self.decode_url):
            _wait_http(url + "/health")

    def _start_serve(
        self, args: argparse.Namespace, role: str, log_name: str, extra: list[str], profile: Path | None
    ) -> tuple[subprocess.Popen[str], list[str]]:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "serve",
            "--role",
            role,
            "--prefill-url",
            self.prefill_url,
            "--decode-url",
            self.decode_url,
            "--log-level",
            args.gateway_log_level,
            "--engines",
            args.engines,
            *extra,
        ]
        if args.uvloop:
            cmd.append("--uvloop")
        if role != "control" and args.tokenize == "local" and self.tokenizer_dir is not None:
            cmd += ["--tokenizer-dir", str(self.tokenizer_dir)]
        if profile:
            cmd += ["--profile", str(profile)]
        log = open(self.tmp / log_name, "ab")  # noqa: SIM115 - lives as long as the process
        cpus = args.gateway_cpus if role == "gateway" else args.other_cpus
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=_pinned(cpus))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"{role} process did not start (see {self.tmp / log_name}): {line!r}")
        return proc, line.split()[1:]

    def start_gateway(self, args: argparse.Namespace, profile: Path | None = None) -> None:
        """``--layout split`` (the production shape): registry + lease manager in one process, the gateway
        in another. ``all-in-one``: everything in one process (``kvbridge up``)."""
        if args.layout == "all-in-one":
            self.gateway, (self.gateway_url,) = self._start_serve(args, "all", "gateway.log", [], profile)
            return
        self.start_control(args)
        registry, lease = self.control_addresses
        self.gateway, (self.gateway_url,) = self._start_serve(
            args, "gateway", "gateway.log", ["--registry", registry, "--lease", lease], profile
        )

    def start_control(self, args: argparse.Namespace) -> None:
        """The registry + lease manager process (``--layout split``), once."""
        if self.control is None:
            self.control, (registry, lease) = self._start_serve(args, "control", "control.log", [], None)
            self.control_addresses = (registry, lease)

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
            self.gateway = None

    def stop_all(self) -> None:
        self.stop_gateway()
        if self.control is not None:
            self.control.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.control.wait(timeout=30)
            self.control = None
        for proc in self.sims:
            proc.terminate()
        for proc in self.sims:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def cpu(self) -> dict[str, float]:
        out = {"client": sum(os.times()[:2])}
        if self.gateway is not None:
            out["gateway" if self.control is not None else "gateway+control plane"] = _cpu_s(self.gateway.pid)
        if self.control is not None:
            out["control plane"] = _cpu_s(self.control.pid)
        out["prefill sim"] = _cpu_s(self.sims[0].pid)
        out["decode sim"] = _cpu_s(self.sims[1].pid)
        return out


def _wait_http(url: str, timeout_s: float = 90.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


# ---- load ---------------------------------------------------------------------------------------------------


@dataclass
class Pair:
    gateway_s: float
    direct_s: float
    verdict: str
    same_answer: bool
    prompt_tokens: int = 0  # the gateway turn's usage.prompt_tokens
    turn: int = 0  # the turn's index in its conversation (0: a new conversation)


@dataclass
class Level:
    concurrency: int
    prompt_words: int = 0  # first prompt of each conversation (--prompt-tokens levels; 0: --prompt-words)
    target_tokens: int = 0  # the --prompt-tokens level this is
    pairs: list[Pair] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu_s: dict[str, float] = field(default_factory=dict)
    router_overhead_mean_s: float = float("nan")  # the gateway's own histogram (excludes engine time)
    router_overhead_buckets: dict[float, float] = field(default_factory=dict)  # bucket bound (s) -> turns, cumulative
    tokenize_paths: dict[str, float] = field(default_factory=dict)  # kvbridge_gateway_tokenize_total deltas
    lookup_sources: dict[str, float] = field(default_factory=dict)  # kvbridge_gateway_lookups_total deltas
    seconds: float = 0.0
    declined: dict[str, int] = field(default_factory=dict)  # P's declined pulls so far (connector mode)


class TurnFailed(Exception):
    pass


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        data: dict[str, Any] = await resp.json(content_type=None)
        if resp.status != 200:
            raise TurnFailed(f"{url.rsplit('/', 3)[-3]} {resp.status}")
        return data


async def gateway_turn(
    http: aiohttp.ClientSession, gw: str, msgs: list[dict[str, str]], conv: str, max_tokens: int
) -> tuple[str, str, int]:
    body: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens}
    if conv:  # "": a keyless client (--keyless), found by its content
        body["conversation_id"] = conv
    async with http.post(gw + "/v1/chat/completions", json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise TurnFailed(f"gateway {resp.status}")
        verdict = resp.headers.get("x-kvbridge-reuse", "").split(";")[0]
    return (
        str(data["choices"][0]["message"]["content"]),
        verdict,
        int((data.get("usage") or {}).get("prompt_tokens") or 0),
    )


async def direct_turn(
    http: aiohttp.ClientSession,
    p_url: str,
    d_url: str,
    msgs: list[dict[str, str]],
    max_tokens: int,
    retained: dict[str, Any] | None,
) -> tuple[str, dict[str, Any] | None]:
    """Prefill on P (max_tokens=1, do_remote_decode; pulling D's retained prefix if any), then decode on D."""
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if retained:
        k = int(retained.get("remote_num_tokens") or 0) // BLOCK * BLOCK
        if k >= REUSE_THRESHOLD:
            params.update(
                {
                    key: retained[key]
                    for key in (
                        "remote_engine_id",
                        "remote_request_id",
                        "remote_host",
                        "remote_port",
                        "tp_size",
                        "pp_size",
                        "dcp_size",
                    )
                }
            )
            params["remote_block_ids"] = [g[: k // BLOCK] for g in retained["remote_block_ids"]]
            params["remote_num_tokens"] = k
    p = await _post(
        http,
        p_url + "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": 1, "stream": False, "kv_transfer_params": params},
    )
    d = await _post(
        http,
        d_url + "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "kv_transfer_params": p["kv_transfer_params"]},
    )
    return str(d["choices"][0]["message"]["content"]), d.get("kv_transfer_params")


async def worker(
    idx: int, level: Level, procs: Procs, args: argparse.Namespace, record_from: float, stop_at: float
) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        conv_n = 0
        while time.monotonic() < stop_at:
            # Unique per level too: a conversation id reused by the next level would find the last level's entry.
            conv = f"c{level.concurrency}-{level.target_tokens}-{idx}-{conv_n}-{os.getpid()}"
            first = " ".join(
                f"w{(idx * 13 + conv_n * 7 + i) % 500 + 10}" for i in range(level.prompt_words or args.prompt_words)
            )
            if args.keyless:  # a word of its own, so that no two conversations share their first prompt
                first = f"{conv} {first}"
            msgs = [{"role": "user", "content": first}]
            retained: dict[str, Any] | None = None
            conv_n += 1
            for turn in range(args.turns):
                if time.monotonic() >= stop_at:
                    return
                try:
                    t_gw = t_direct = 0.0
                    for leg in (0, 1) if (turn + idx) % 2 == 0 else (1, 0):
                        started = time.perf_counter()
                        if leg == 0:
                            gw_answer, verdict, prompt_tokens = await gateway_turn(
                                http, procs.gateway_url, msgs, "" if args.keyless else conv, args.max_tokens
                            )
                            t_gw = time.perf_counter() - started
                        else:
                            answer, retained = await direct_turn(
                                http,
                                procs.prefill_url,
                                procs.decode_url,
                                msgs,
                                args.max_tokens,
                                retained if args.direct_mode == "pull" else None,
                            )
                            t_direct = time.perf_counter() - started
                except (TimeoutError, TurnFailed, aiohttp.ClientError, KeyError, TypeError) as exc:
                    level.errors[str(exc) if isinstance(exc, TurnFailed) else type(exc).__name__] += 1
                    break
                if time.monotonic() >= record_from:
                    level.pairs.append(Pair(t_gw, t_direct, verdict, gw_answer == answer, prompt_tokens, turn))
                msgs = [
                    *msgs,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"w{turn + 11} w{idx % 400 + 10} and tell me more about it"},
                ]
                await asyncio.sleep(args.think_ms / 1000)


async def _router_overhead(gw: str) -> tuple[float, float, dict[float, float]]:
    """(sum, count, cumulative count by bucket bound) of the gateway's kvbridge_gateway_router_overhead_seconds."""
    async with aiohttp.ClientSession() as http, http.get(gw + "/metrics") as resp:
        text = await resp.text()
    vals: dict[str, float] = {}
    buckets: dict[float, float] = {}
    name = "kvbridge_gateway_router_overhead_seconds"
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " ") or line.startswith(name + suffix + "{"):
                vals[suffix] = vals.get(suffix, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith(name + '_bucket{le="') and "+Inf" not in line:
            bound = float(line.split('le="', 1)[1].split('"', 1)[0])
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return vals.get("_sum", 0.0), vals.get("_count", 0.0), buckets


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The bound of the first bucket holding the ``q`` quantile (an upper bound on it); nan without turns, inf
    past the last bound."""
    total = max(buckets.values(), default=0.0)
    if total <= 0:
        return float("nan")
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("inf")


async def _counters(gw: str) -> dict[str, dict[str, float]]:
    """The gateway's per-turn counters by label: tokenize path (local, engine, request) and lookup source
    (mirror, registry)."""
    async with aiohttp.ClientSession() as http, http.get(gw + "/metrics") as resp:
        text = await resp.text()
    wanted = {"kvbridge_gateway_tokenize_total{": 'path="', "kvbridge_gateway_lookups_total{": 'source="'}
    out: dict[str, dict[str, float]] = {name: {} for name in wanted}
    for line in text.splitlines():
        for name, label in wanted.items():
            if line.startswith(name) and label in line:
                value = line.split(label, 1)[1].split('"', 1)[0]
                out[name][value] = float(line.rsplit(" ", 1)[1])
    return out


def _deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


async def run_level(
    procs: Procs,
    concurrency: int,
    seconds: float,
    args: argparse.Namespace,
    prompt_words: int = 0,
    target_tokens: int = 0,
) -> Level:
    level = Level(concurrency, prompt_words, target_tokens)
    level.load_before = os.getloadavg()
    start = time.monotonic()
    record_from, stop_at = start + args.warmup_s, start + args.warmup_s + seconds
    tasks = [asyncio.create_task(worker(i, level, procs, args, record_from, stop_at)) for i in range(concurrency)]
    metrics_at_start: tuple[float, float, dict[float, float]] | None = None
    cpu0: dict[str, float] = {}
    counters0: dict[str, dict[str, float]] = {}
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        now = time.monotonic()
        if metrics_at_start is None and now >= record_from:
            metrics_at_start, cpu0 = await _router_overhead(procs.gateway_url), procs.cpu()
            counters0 = await _counters(procs.gateway_url)
        if metrics_at_start is not None and int(now - start) % 5 == 0:
            added = [p.gateway_s - p.direct_s for p in level.pairs]
            print(
                f"  [{concurrency:>2} conv {target_tokens or ''}] t={now - start:5.1f}s pairs={len(level.pairs):5d} "
                f"added p50={pct(added, 0.5) * 1e3:6.2f} ms errors={sum(level.errors.values())} "
                f"load={os.getloadavg()[0]:.1f}",
                flush=True,
            )
    for t in tasks:
        t.result()
    level.seconds = time.monotonic() - record_from
    level.load_after = os.getloadavg()
    async with aiohttp.ClientSession() as http, http.get(procs.prefill_url + "/sim/stats") as resp:
        connector = (await resp.json()).get("kvbridge") or {}
    level.declined = dict(connector.get("declined") or {})
    if metrics_at_start is not None:
        cpu1 = procs.cpu()
        level.cpu_s = {k: cpu1[k] - cpu0[k] for k in cpu1}
        s1, c1, buckets1 = await _router_overhead(procs.gateway_url)
        level.router_overhead_buckets = {b: n - metrics_at_start[2].get(b, 0.0) for b, n in buckets1.items()}
        counters1 = await _counters(procs.gateway_url)
        tok, lookups = "kvbridge_gateway_tokenize_total{", "kvbridge_gateway_lookups_total{"
        level.tokenize_paths = _deltas(counters0.get(tok, {}), counters1[tok])
        level.lookup_sources = _deltas(counters0.get(lookups, {}), counters1[lookups])
        if c1 > metrics_at_start[1]:
            level.router_overhead_mean_s = (s1 - metrics_at_start[0]) / (c1 - metrics_at_start[1])
    return level


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- report -------------------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


_PACKAGES = (
    "httpx",
    "httpcore",
    "anyio",
    "h11",
    "grpc",
    "google/protobuf",
    "uvicorn",
    "starlette",
    "opentelemetry",
    "prometheus_client",
    "logging",
    "asyncio",
    "selectors",
    "json",
    "kvbridge_services",
    "kvbridge",
)


def by_package(path: Path) -> list[tuple[str, float]]:
    """Own (tottime) seconds per package: which libraries the process spends its CPU in."""
    stats = pstats.Stats(str(path))
    totals: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = "builtins/C (socket send, epoll, ...)" if filename == "~" else "other"
        for pkg in _PACKAGES:
            if (
                f"/{pkg}/" in filename
                or filename.endswith(f"/{pkg}.py")
                or (pkg == "kvbridge" and "/api/kvbridge/" in filename)
            ):
                where = pkg
                break
        if filename == "~" and ("epoll" in func or "select" in func):
            where = "epoll wait (idle)"
        totals[where] = totals.get(where, 0.0) + tottime
    return sorted(totals.items(), key=lambda kv: -kv[1])


def profile_summary(path: Path, top: int = 25) -> str:
    out = io.StringIO()
    total = sum(t for _, t in by_package(path))
    out.write("Own time by package (cProfile tottime):\n")
    for name, secs in by_package(path):
        out.write(f"  {name:<40} {secs:7.2f} s  {100 * secs / total:5.1f} %\n")
    out.write("\n")
    stats = pstats.Stats(str(path), stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _level_name(lv: Level) -> str:
    if lv.target_tokens:
        return f"{lv.target_tokens // 1024}K-token prompts"
    return f"{lv.concurrency} conversation{'s' if lv.concurrency > 1 else ''}"


def _p50_goal_s(lv: Level) -> float | None:
    """The issue's p50 goal: 2 ms (1 conversation, or prompts up to 24K tokens), 5 ms at 128K, none between."""
    if not lv.target_tokens:
        return 0.002
    if lv.target_tokens <= 24 * 1024:
        return 0.002
    return 0.005 if lv.target_tokens >= 128 * 1024 else None


def _verdict(added: list[float], lv: Level) -> str:
    goal = _p50_goal_s(lv)
    p50, p99 = pct(added, 0.5), pct(added, 0.99)
    parts = []
    if goal is not None:
        parts.append(f"p50 {'met' if p50 <= goal else '**not met**'}")
    if lv.target_tokens:
        parts.append(f"p99 {'met' if p99 <= 3 * max(p50, 0.0) else '**not met**'}")
    return ", ".join(parts) or "-"


def write_report(
    levels: list[Level], args: argparse.Namespace, out: Path, command: str, profile_text: str | None
) -> None:
    rows = ["| figure | " + " | ".join(_level_name(lv) for lv in levels) + " |", "| --- |" + " --- |" * len(levels)]

    def row(name: str, fn: Any) -> None:
        rows.append(f"| {name} | " + " | ".join(fn(lv) for lv in levels) + " |")

    def added(lv: Level) -> list[float]:
        return [p.gateway_s - p.direct_s for p in lv.pairs]

    row("turn pairs measured (after warm-up)", lambda lv: f"{len(lv.pairs)} in {lv.seconds:.0f} s")
    if any(lv.target_tokens for lv in levels):
        row(
            "prompt tokens per turn, min / median / max (usage)",
            lambda lv: " / ".join(f"{pct([p.prompt_tokens for p in lv.pairs], q):.0f}" for q in (0.0, 0.5, 1.0)),
        )
    row("errors", lambda lv: str(sum(lv.errors.values())) + (f" {dict(lv.errors)}" if lv.errors else ""))
    row(
        "gateway p50 / p99 (ms)",
        lambda lv: " / ".join(_ms(pct([p.gateway_s for p in lv.pairs], q)) for q in (0.5, 0.99)),
    )
    row(
        "direct p50 / p99 (ms)", lambda lv: " / ".join(_ms(pct([p.direct_s for p in lv.pairs], q)) for q in (0.5, 0.99))
    )
    row(
        "**added per turn (paired) p50 / p99 (ms)**",
        lambda lv: "**" + " / ".join(_ms(pct(added(lv), q)) for q in (0.5, 0.99)) + "**",
    )
    row(
        "p50(gateway) - p50(direct) (ms)",
        lambda lv: _ms(pct([p.gateway_s for p in lv.pairs], 0.5) - pct([p.direct_s for p in lv.pairs], 0.5)),
    )
    row(
        "added p50, reuse hits only (ms)",
        lambda lv: _ms(pct([p.gateway_s - p.direct_s for p in lv.pairs if p.verdict == "hit"], 0.5)),
    )
    for label, first in (("first turns (a new conversation)", True), ("later turns", False)):
        row(
            f"added p50 / p99, {label} (ms)",
            lambda lv, first=first: " / ".join(
                _ms(pct([p.gateway_s - p.direct_s for p in lv.pairs if (p.turn == 0) == first], q)) for q in (0.5, 0.99)
            ),
        )
    row("gateway's own router-overhead metric, mean (ms)", lambda lv: _ms(lv.router_overhead_mean_s))
    row(
        "gateway's own router-overhead metric, p50 / p99 (ms, at most: histogram bucket bounds)",
        lambda lv: " / ".join(_ms(bucket_quantile(lv.router_overhead_buckets, q)) for q in (0.5, 0.99)),
    )
    row(
        "turns by tokenize path (gateway metric)",
        lambda lv: ", ".join(f"{k}: {v:.0f}" for k, v in sorted(lv.tokenize_paths.items())) or "-",
    )
    row(
        "lookups by source (gateway metric)",
        lambda lv: ", ".join(f"{k}: {v:.0f}" for k, v in sorted(lv.lookup_sources.items())) or "-",
    )
    row("target (p50 added ≤ 2 ms to 24K tokens, ≤ 5 ms at 128K; p99 ≤ 3x p50)", lambda lv: _verdict(added(lv), lv))
    row(
        "reuse verdicts (gateway)",
        lambda lv: ", ".join(f"{k}: {v}" for k, v in sorted(Counter(p.verdict for p in lv.pairs).items())),
    )
    row("same answer gateway vs direct", lambda lv: f"{sum(p.same_answer for p in lv.pairs)}/{len(lv.pairs)}")
    if args.engines == "connector":
        row(
            "pulls P declined, whole run (both paths must pull: none expected)",
            lambda lv: ", ".join(f"{k}: {v}" for k, v in sorted(lv.declined.items())) or "0",
        )
    for name in ("gateway+control plane", "gateway", "control plane", "prefill sim", "decode sim", "client"):
        if not any(name in lv.cpu_s for lv in levels):
            continue
        row(
            f"CPU ms per turn pair: {name}",
            lambda lv, n=name: f"{lv.cpu_s.get(n, float('nan')) * 1e3 / max(1, len(lv.pairs)):.2f}",
        )
    row("load average (1 min) before → after", lambda lv: f"{lv.load_before[0]:.2f} → {lv.load_after[0]:.2f}")

    layout = (
        "gateway + registry + lease manager in one process (kvbridge_services.stack.Stack, embedded in-memory store)"
        if args.layout == "all-in-one"
        else "the gateway in its own process, registry + lease manager (Stack without gateway, embedded "
        "in-memory store) in another, talking gRPC over loopback as in production"
    )
    pull_note = ", pulling the previous turn from D like a gateway hit" if args.direct_mode == "pull" else ""
    tokenize_note = {
        "local": "the simulators tokenize with the dev HF tokenizer + chat template "
        "(kvbridge_services.devengines.model) and the gateway tokenizes in-process with the same files",
        "engine": "the simulators tokenize with the dev HF tokenizer + chat template and the gateway asks P's "
        "/tokenize",
        "sim": "the simulators' whitespace tokenizer; the gateway asks P's /tokenize",
    }[args.tokenize]
    engines_note, registration_note = {
        "stock": (
            "stock-like (`--engines stock`, compatibility mode: the gateway registers D's state after each turn "
            "from D's returned token ids, and consumes a single-use entry before P pulls)",
            "compatibility-mode registration",
        ),
        "connector": (
            "running the kvbridge connector's control plane (`--engines connector`, connector mode: "
            "tests/tools/sim_connector.py; the engines register themselves, D registers each turn's entry under "
            "its own lease and holds the blocks by reference, P checks the gateway's prompt-prefix digest; P "
            "accepts offers with no signature, digest or deadline so that the direct path, which holds no secret "
            "and no tokenizer, can pull)",
            "D's connector registers",
        ),
    }[args.engines]
    lines = [
        "# Gateway router overhead vs calling the engines directly",
        "",
        f"Command: `{command}`",
        "",
        f"Setup: engine simulators (test tool) for one prefill and one decode engine, each in its own process, "
        f"{engines_note}, "
        f"{args.prefill_us_per_token} us/prompt token (TTFT) and {args.decode_us_per_token} us/output token, "
        f"{args.max_tokens} output tokens; {layout}, gateway log level {args.gateway_log_level}"
        f"{', on uvloop' if args.uvloop else ''}; this load client (aiohttp) in its own process. "
        f"Tokenization (`--tokenize {args.tokenize}`): {tokenize_note}. "
        + (
            f"Conversations of {args.turns} turns starting from a prompt of about the level's size (words "
            f"calibrated with P's /tokenize), one conversation at a time, simulators started with --max-model-len "
            f"{args.max_model_len}, "
            if args.prompt_tokens
            else f"Conversations of {args.turns} turns starting from {args.prompt_words} words, "
        )
        + f"{args.think_ms} ms think time; each turn is sent through the gateway ("
        + ("no `conversation_id`: a keyless thread" if args.keyless else "`conversation_id` set")
        + ": lookup, "
        f"pull, {registration_note}) and directly ({args.direct_mode} mode: prefill max_tokens=1 + "
        f"do_remote_decode{pull_note}, then decode with P's params), alternating which goes first, "
        f"with identical prompts. "
        f"Warm-up {args.warmup_s} s per level not counted. Machine: 2 cores shared with other engineers' work "
        f"(load averages below)"
        + (
            f"; the gateway pinned to CPU(s) {sorted(args.gateway_cpus)}, every other process (simulators, control "
            f"plane, load client) to CPU(s) {sorted(args.other_cpus)}."
            if args.gateway_cpus is not None
            else "."
        ),
        "",
        *rows,
        "",
        "Added per turn = gateway latency - direct latency of the same turn pair (client-measured, end to end).",
        "The gateway's own metric (kvbridge_gateway_router_overhead_seconds) is its time per turn outside the "
        "prefill call up to sending the decode (tokenization, local or P's /tokenize round trip, and the lookup "
        "included), so it omits the extra "
        "client→gateway hop and the response relay.",
        "",
        f"![latency CDFs and added latency]({out.name}_overhead.png)",
    ]
    if profile_text is not None:
        where = (
            f"{max(args.prompt_tokens) // 1024}K-token prompts"
            if args.prompt_tokens
            else f"{max(args.levels)} conversations"
        )
        lines += [
            "",
            f"Profile: cProfile of the gateway process during a {args.profile_seconds:.0f} s "
            f"run at {where} (not part of the figures above); full listing in "
            f"`{out.name}_profile.txt`.",
            "",
            "```",
            profile_text.split("\n\n", 1)[0],
            "```",
        ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if levels and levels[0].target_tokens:
        plot_by_size(levels, path, plt)
        return

    fig, axes = plt.subplots(1, len(levels) + 1, figsize=(5 * (len(levels) + 1), 4))
    for ax, lv in zip(axes, levels, strict=False):
        for label, vals in (("gateway", [p.gateway_s for p in lv.pairs]), ("direct", [p.direct_s for p in lv.pairs])):
            xs = sorted(v * 1e3 for v in vals)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        ax.set_title(f"turn latency, {lv.concurrency} concurrent conversation(s)")
        ax.set_xlabel("ms")
        ax.set_ylabel("CDF")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[-1]
    ax.boxplot([[(p.gateway_s - p.direct_s) * 1e3 for p in lv.pairs] for lv in levels], showfliers=False, whis=(1, 99))
    ax.set_xticks(range(1, len(levels) + 1), [f"{lv.concurrency} conv" for lv in levels])
    ax.axhline(2.0, color="red", linestyle="--", label="target p50 ≤ 2 ms")
    ax.set_title("added latency per turn (gateway - direct), whiskers p1/p99")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_by_size(levels: list[Level], path: Path, plt: Any) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    xs = [lv.target_tokens for lv in levels]
    for q, style in ((0.5, "o-"), (0.99, "s--")):
        ax.plot(
            xs,
            [pct([p.gateway_s - p.direct_s for p in lv.pairs], q) * 1e3 for lv in levels],
            style,
            label=f"added p{int(q * 100)}",
        )
    ax.plot([2048, 24 * 1024], [2, 2], "r:", label="goal p50 ≤ 2 ms (to 24K)")
    ax.plot([128 * 1024], [5], "rv", label="goal p50 ≤ 5 ms (128K)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}K" for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms added per turn (gateway - direct)")
    ax.set_title("gateway added latency by prompt size, 1 conversation")
    ax.legend()
    ax.grid(alpha=0.3)
    for label, key in (("gateway", "gateway_s"), ("direct", "direct_s")):
        ax2.plot(xs, [pct([getattr(p, key) for p in lv.pairs], 0.5) * 1e3 for lv in levels], "o-", label=label)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks(xs, [f"{x // 1024}K" for x in xs])
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("turn p50 (ms)")
    ax2.set_title("turn latency p50")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def calibrate_words(prefill_url: str, tokens: int) -> int:
    """Words of the bench's first prompt that P's /tokenize (the engines' own tokenizer) counts as ~tokens."""
    sample = 2000
    text = " ".join(f"w{i % 500 + 10}" for i in range(sample))
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            prefill_url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}
        ) as resp,
    ):
        count = int((await resp.json(content_type=None))["count"])
    return max(1, int(tokens * sample / count))


# ---- main ---------------------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, procs: Procs) -> tuple[list[Level], Path | None]:
    levels = []
    for tokens in args.prompt_tokens:
        words = await calibrate_words(procs.prefill_url, tokens)
        print(
            f"level: {tokens}-token prompts ({words} words), 1 conversation, {args.seconds:.0f} s "
            f"(+{args.warmup_s:.0f} s warm-up)",
            flush=True,
        )
        lv = await run_level(procs, 1, args.seconds, args, words, tokens)
        added = [p.gateway_s - p.direct_s for p in lv.pairs]
        print(
            f"  done: {len(lv.pairs)} pairs, added p50 {_ms(pct(added, 0.5))} ms p99 {_ms(pct(added, 0.99))} ms",
            flush=True,
        )
        levels.append(lv)
    for conc in [] if args.prompt_tokens else args.levels:
        print(
            f"level: {conc} concurrent conversation(s), {args.seconds:.0f} s (+{args.warmup_s:.0f} s warm-up)",
            flush=True,
        )
        lv = await run_level(procs, conc, args.seconds, args)
        added = [p.gateway_s - p.direct_s for p in lv.pairs]
        print(
            f"  done: {len(lv.pairs)} pairs, added p50 {_ms(pct(added, 0.5))} ms p99 {_ms(pct(added, 0.99))} ms",
            flush=True,
        )
        levels.append(lv)
    prof_path = None
    if args.profile_seconds > 0:
        prof_path = procs.tmp / "gateway.prof"
        print(f"profile: restarting the gateway under cProfile, {args.profile_seconds:.0f} s", flush=True)
        procs.stop_gateway()
        procs.start_gateway(args, profile=prof_path)
        if args.prompt_tokens:
            tokens = max(args.prompt_tokens)
            await run_level(
                procs, 1, args.profile_seconds, args, await calibrate_words(procs.prefill_url, tokens), tokens
            )
        else:
            await run_level(procs, max(args.levels), args.profile_seconds, args)
        procs.stop_gateway()
    return levels, prof_path


def _cpu_set(text: str) -> set[int]:
    return {int(c) for c in text.split(",") if c.strip()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 32],
        help="concurrent conversations per level (default 1,32)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="levels by prompt size instead of --levels: one conversation per level whose first prompt "
        "is about this many tokens (e.g. 2048,8192,24576,65536,131072)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="the simulators' context length (default: 8192, or the largest --prompt-tokens + 8192)",
    )
    p.add_argument(
        "--keyless",
        action="store_true",
        help="the client sends no conversation_id (keyless threads, ADR 0022): compare with a run without it",
    )
    p.add_argument("--seconds", type=float, default=45.0, help="measured seconds per level")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--profile-seconds", type=float, default=20.0, help="0: no profiled run")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--think-ms", type=float, default=20.0)
    p.add_argument("--prefill-us-per-token", type=float, default=2.0)
    p.add_argument("--decode-us-per-token", type=float, default=100.0)
    p.add_argument("--direct-mode", choices=["pull", "plain"], default="pull")
    p.add_argument(
        "--engines",
        choices=["stock", "connector"],
        default="stock",
        help="stock: stock-like simulators the gateway registers (compatibility mode: single-use entries, D's "
        "token ids returned); connector: the simulators run the kvbridge connector's control plane and register "
        "themselves and D's entries (connector mode, the mode kvbridge ships; needs --layout split)",
    )
    p.add_argument(
        "--uvloop",
        action="store_true",
        help="run the kvbridge processes on uvloop (the services themselves use the default asyncio loop)",
    )
    p.add_argument(
        "--layout",
        choices=["split", "all-in-one"],
        default="split",
        help="split: gateway and control plane in separate processes (production shape)",
    )
    p.add_argument("--gateway-log-level", default="INFO", help="the gateway's default is INFO (a line per turn)")
    p.add_argument(
        "--tokenize",
        choices=["local", "engine", "sim"],
        default="local",
        help="local: the simulators use the dev HF tokenizer + chat template (built into a temporary "
        "directory) and the gateway tokenizes with the same files in-process; engine: same simulators, "
        "the gateway asks P's /tokenize; sim: the simulators' whitespace tokenizer, P's /tokenize",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/gateway"))
    p.add_argument("--logs-dir", type=Path, help="keep process logs here (default: a temporary directory)")
    p.add_argument(
        "--gateway-cpus",
        type=_cpu_set,
        help="pin the gateway process to these CPUs (e.g. 0), as a "
        "deployment gives it cores of its own; needs --other-cpus",
    )
    p.add_argument(
        "--other-cpus",
        type=_cpu_set,
        help="pin the simulators, the control plane and this load client to these CPUs (e.g. 1)",
    )
    args = p.parse_args()
    if not args.max_model_len:
        args.max_model_len = max([8192, *(t + 8192 for t in args.prompt_tokens)])
    if args.engines == "connector" and args.layout != "split":
        p.error("--engines connector needs --layout split (the engines register with the control process)")
    if (args.gateway_cpus is None) != (args.other_cpus is None):
        p.error("--gateway-cpus and --other-cpus go together")
    if args.other_cpus is not None:
        os.sched_setaffinity(0, args.other_cpus)  # this load client
    command = "python bench/gateway_overhead.py " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        procs = Procs(args.logs_dir or Path(tmp))
        try:
            procs.build_tokenizer(args)
            if args.engines == "connector":
                procs.start_control(args)  # the engines' connectors register there as they start
            procs.start_sims(args)
            procs.start_gateway(args)
            print(f"sims: P {procs.prefill_url}, D {procs.decode_url}; gateway {procs.gateway_url}", flush=True)
            levels, prof_path = asyncio.run(bench(args, procs))
        finally:
            procs.stop_all()
        profile_text = None
        if prof_path is not None and prof_path.exists():
            profile_text = profile_summary(prof_path)
            Path(f"{args.out}_profile.txt").write_text(profile_text)
    plot(levels, args.out.parent / f"{args.out.name}_overhead.png")
    write_report(levels, args, args.out, command, profile_text)
    Path(f"{args.out}_pairs.json").write_text(
        json.dumps(
            [
                {
                    "level": _level_name(lv),
                    "errors": dict(lv.errors),
                    "pairs": [dataclasses.asdict(p) for p in lv.pairs],
                }
                for lv in levels
            ]
        )
    )
    print(
        f"wrote {args.out}.md, {args.out}_overhead.png, {args.out}_pairs.json"
        + (f", {args.out}_profile.txt" if profile_text else "")
    )


if __name__ == "__main__":
    main()
