"""A decode engine with a small KV cache under concurrent conversations: reuse on against reuse off (issue 30).

    .venv/bin/python bench/retention_pressure.py --engines vllm --out bench/results/retention_pressure
    .venv/bin/python bench/retention_pressure.py --engines sim --out bench/results/retention_pressure_sim

``--conversations`` conversations (12) send ``--turns`` turns each (6) through the gateway, all at once, each
turn as soon as the previous one answered; D holds ``--decode-blocks`` KV blocks (96). The same turns run twice on
the same engines and control plane: with reuse (the gateway pulls D's retained KV back to P) and without
(``reuse_enabled=false``), each under its own ``cache_salt`` so neither finds the other's prompts in the engines'
prefix caches. Reported per run: wall time, verdicts (hits), errors; then answers that differ between the runs
(greedy: reuse must not change an answer).

* ``--engines vllm``: real vLLM CPU engines (tests/fixtures/vllm_engines.py: a tiny random-weight model, P on
  core 0, D on core 1) with the kvbridge connector, the real control plane (etcd, registry and lease manager
  processes); D gets ``--num-gpu-blocks-override``. Prompts are token ids: 160..320 random ones, and each turn
  adds the answer (``--output-tokens``, ``ignore_eos``) and 40 more (as tests/e2e/test_small_cache_pressure.py).
* ``--engines sim``: engine simulators (tests/tools/engine_sim.py) with vLLM's admission model
  (``SimConfig.admission``) and the connector's own retention table, in-process registry, lease manager and
  gateway; seconds instead of minutes.

Writes <out>.md (the figures and the command) and <out>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from kvbridge_services.gateway.app import GatewayApp  # noqa: E402


@dataclass
class Turn:
    conversation: str
    index: int
    prompt: list[int]
    status: int = 0
    verdict: str = ""
    output: list[int] = field(default_factory=list)
    error: str = ""


@dataclass
class Run:
    reuse: bool
    wall_s: float
    turns: list[Turn]

    def summary(self) -> dict[str, Any]:
        verdicts = collections.Counter(t.verdict.split(";")[0] for t in self.turns)
        return {
            "reuse": self.reuse,
            "wall_s": round(self.wall_s, 2),
            "turns": len(self.turns),
            "errors": sum(t.status != 200 for t in self.turns),
            "hits": verdicts.get("hit", 0),
            "verdicts": dict(verdicts),
            "first_error": next((t.error for t in self.turns if t.error), ""),
        }


async def run_turns(
    gw: GatewayApp, model: str, prompts: dict[str, list[int]], args: argparse.Namespace, *, reuse: bool
) -> Run:
    """Every conversation runs its turns in order, all conversations at once."""
    salt = f"bench-{'on' if reuse else 'off'}"
    prompts = {k: list(v) for k, v in prompts.items()}
    done: list[Turn] = []

    async def one(conv: str, c: httpx.AsyncClient) -> None:
        growth = random.Random(conv)
        for t in range(args.turns):
            turn = Turn(conv, t, list(prompts[conv]))
            r = await c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": turn.prompt,
                    "max_tokens": args.output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "conversation_id": f"{salt}-{conv}",
                    "cache_salt": salt,
                    "return_token_ids": True,
                },
            )
            turn.status = r.status_code
            if r.status_code != 200:
                turn.error = r.text[:300]
                done.append(turn)
                return
            turn.verdict = r.headers.get("x-kvbridge-reuse", "")
            turn.output = list(r.json()["choices"][0]["token_ids"])
            done.append(turn)
            prompts[conv] = prompts[conv] + turn.output + [growth.randrange(8, 500) for _ in range(40)]

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=1800) as c:
        await asyncio.gather(*(one(conv, c) for conv in prompts))
    wall = time.monotonic() - start
    await gw.core.router.drain()
    return Run(reuse, wall, done)


def differing(a: Run, b: Run) -> list[tuple[str, int]]:
    outputs = {(t.conversation, t.index): t.output for t in b.turns if t.status == 200}
    return [
        (t.conversation, t.index)
        for t in a.turns
        if t.status == 200 and (t.conversation, t.index) in outputs and outputs[(t.conversation, t.index)] != t.output
    ]


# ---- real vLLM engines ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def vllm_gateways(args: argparse.Namespace, work: Path) -> AsyncIterator[tuple[str, Any, Any]]:
    from tests.e2e.conftest import kvbridge_overrides
    from tests.e2e.gateway_turns import registry_routed_gateway
    from tests.fixtures.control_plane_procs import run_control_plane
    from tests.fixtures.tiny_model import model_dir_for_engines
    from tests.fixtures.vllm_engines import run_pd_engines

    model_dir = model_dir_for_engines(work / "model")
    with run_control_plane(work / "control-plane") as procs:
        prefill, decode = kvbridge_overrides(procs)
        decode["extra_args"] = ["--num-gpu-blocks-override", str(args.decode_blocks)]
        with run_pd_engines(model_dir, work / "engines", prefill_overrides=prefill, decode_overrides=decode) as pd:

            @contextlib.asynccontextmanager
            async def gateway(reuse: bool) -> AsyncIterator[GatewayApp]:
                async with registry_routed_gateway(procs, reuse=reuse) as gw:
                    yield gw

            yield "tiny", gateway, pd


# ---- engine simulators ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sim_gateways(args: argparse.Namespace, work: Path) -> AsyncIterator[tuple[str, Any, Any]]:
    from tests.tools.engine_sim import SimConfig, SimServer

    from kvbridge_services.common.auth import Authenticator
    from kvbridge_services.common.config import ServerSettings
    from kvbridge_services.common.store.memory import MemoryStore
    from kvbridge_services.gateway.config import GatewaySettings
    from kvbridge_services.lease.policy import LeasePolicy
    from kvbridge_services.registry.config import RegistrySettings
    from kvbridge_services.stack import ServiceStack

    secret = "00112233445566778899aabbccddeeff"
    store = MemoryStore()
    async with contextlib.AsyncExitStack() as held:
        held.push_async_callback(store.close)
        services = await held.enter_async_context(
            ServiceStack(
                store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5, min_ttl_s=0.1),
                registry=RegistrySettings(port=0),
                server=ServerSettings(shutdown_grace_s=0.2),
                stop_grace_s=0.1,
            )
        )
        assert services.registry is not None and services.lease is not None
        config = {
            "kvbridge_registry": services.registry.address,
            "kvbridge_lease": services.lease.address,
            "kvbridge_hash_secret": secret,
        }
        common = {"model": "sim", "block_size": 32, "vocab": 512, "kvbridge_config": config}
        prefill = await held.enter_async_context(
            SimServer(SimConfig(role="prefill", engine_id="p0", prefill_us_per_token=200, **common))  # type: ignore[arg-type]
        )
        decode = await held.enter_async_context(
            SimServer(
                SimConfig(
                    role="decode",
                    engine_id="d0",
                    total_blocks=args.decode_blocks,
                    admission=True,
                    prefix_caching=True,  # as vLLM's D (the dev launcher turns it off on P only)
                    decode_us_per_token=20_000,
                    **common,  # type: ignore[arg-type]
                )
            )
        )

        @contextlib.asynccontextmanager
        async def gateway(reuse: bool) -> AsyncIterator[GatewayApp]:
            settings = GatewaySettings(
                host="127.0.0.1",
                http_port=0,
                grpc_port=0,
                registry_address=services.registry.address,  # type: ignore[union-attr]
                lease_address=services.lease.address,  # type: ignore[union-attr]
                hash_secret_hex=secret,
                default_block_size=32,
                reuse_enabled=reuse,
                engines_from_registry=True,
                registry_refresh_s=0.2,
                registration_wait_s=args.registration_wait_s,
            )
            gw = GatewayApp(settings, auth=Authenticator({}))
            await gw.start()
            try:
                deadline = time.monotonic() + 30
                while not gw.core.ready():
                    assert time.monotonic() < deadline, "the gateway never listed the simulators"
                    await asyncio.sleep(0.05)
                yield gw
            finally:
                await gw.stop()

        yield "sim", gateway, (prefill, decode)


def _sim_extra(engines: Any) -> dict[str, Any]:
    d = engines[1].engine
    return {
        "d_registered": d.connector.registered,
        "d_not_retained": dict(d.connector.not_retained),
        "d_withdrawal_batches": list(d.connector.withdrawal_batches),
        "d_admission_wait_max_s": round(d.stats.admission_wait_max_s, 2),
        "d_unsafe_reads": d.kv.unsafe_reads,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(14)
    prompts = {
        f"pressure-{i}": [rng.randrange(8, 500) for _ in range(rng.randrange(160, 320))]
        for i in range(args.conversations)
    }
    # Alternating order (off, on), (on, off), ...: neither mode always runs on warmer engines.
    order = [mode for r in range(args.repeat) for mode in ((False, True) if r % 2 == 0 else (True, False))]
    runs: list[tuple[Run, dict[str, Any]]] = []
    decode_log = ""
    with tempfile.TemporaryDirectory(prefix="kvbridge-pressure-") as tmp:
        if args.engines == "sim":
            for i, reuse in enumerate(order):  # fresh engines and control plane per run: seconds
                async with sim_gateways(args, Path(tmp) / str(i)) as (model, gateway, engines):
                    async with gateway(reuse) as gw:
                        run = await run_turns(gw, model, prompts, args, reuse=reuse)
                    runs.append((run, _sim_extra(engines)))
                    print(json.dumps({**run.summary(), **runs[-1][1]}), flush=True)
        else:
            async with vllm_gateways(args, Path(tmp)) as (model, gateway, engines):
                for i, reuse in enumerate(order):
                    if i:
                        # The last run's entries end (entry lease TTL, then the grace) before the next starts.
                        await asyncio.sleep(args.settle_s)
                    async with gateway(reuse) as gw:
                        run = await run_turns(gw, model, prompts, args, reuse=reuse)
                    runs.append((run, {}))
                    print(json.dumps(run.summary()), flush=True)
                decode_log = engines.decode.log_path.read_text(errors="replace")
    on = [r for r, _ in runs if r.reuse]
    off = [r for r, _ in runs if not r.reuse]
    on_s, off_s = statistics.median(r.wall_s for r in on), statistics.median(r.wall_s for r in off)
    lines = decode_log.splitlines()
    return {
        "engines": args.engines,
        "decode_blocks": args.decode_blocks,
        "conversations": args.conversations,
        "turns": args.turns,
        "output_tokens": args.output_tokens,
        "runs": [{**r.summary(), **extra} for r, extra in runs],
        "on_wall_s_median": round(on_s, 2),
        "off_wall_s_median": round(off_s, 2),
        "ratio": round(on_s / off_s, 3) if off_s else None,
        "errors": sum(r.summary()["errors"] for r, _ in runs),
        "hits_on": [r.summary()["hits"] for r in on],
        # Greedy answers of each reuse-on run against the first reuse-off run.
        "wrong": [len(differing(r, off[0])) for r in on],
        "d_withdrawing_lines": sum("kvbridge: withdrawing" in line for line in lines),
        "d_not_retaining_lines": sum("kvbridge: not retaining" in line for line in lines),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", choices=("vllm", "sim"), default="sim")
    parser.add_argument("--decode-blocks", type=int, default=96)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument(
        "--registration-wait-s",
        type=float,
        default=0.5,
        help="sim: the gateway's registration_wait_s (the default is the gateway's own)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (alternating which mode goes first)")
    parser.add_argument(
        "--settle-s", type=float, default=40.0, help="vllm: pause between runs (entry leases end, then the grace)"
    )
    parser.add_argument("--out", type=Path, default=None, help="writes <out>.json (and prints the figures)")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
