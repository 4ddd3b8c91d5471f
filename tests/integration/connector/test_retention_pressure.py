"""Retained KV never delays admission (issue 30 item 7, ADR 0026), on engine simulators running the connector's
retention table and control plane (tests/tools/sim_connector.py) behind the gateway, with the real registry and
lease manager (in-process, real gRPC).

D has 96 blocks, vLLM's admission (``SimConfig.admission``: a request takes its blocks before it runs and waits
while the cache lacks them) and its prefix cache. Six conversations run a first turn one after the other: D has
slack and retains them. Then their second turns and a burst of twelve new conversations arrive at once: the second
turns are offered the retained entries, and the burst needs the blocks those entries hold, so D withdraws them
while P's READs are still to come. P starts each READ late, close to the offer's deadline
(``SimConfig.read_delay_s``), and the simulator's READ is one-sided: it returns whatever the blocks hold when it
comes, and counts a read of blocks the request no longer holds (``unsafe_reads``). The invariant: 0 such reads,
every answer equal to the answer without reuse. The goal: the withdrawal comes in a batch, finished requests are
freed at once rather than retained under pressure, and no request waits for blocks longer than one horizon.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.fixtures.gateway_stack import BLOCK, KEYS, MODEL, SECRET_HEX
from tests.tools.engine_sim import SimConfig, SimServer

pytestmark = [pytest.mark.serial]  # asserts a bound on waiting (one horizon, seconds)

DECODE_BLOCKS = 96
CALM = 6
BURST = 12
MAX_TOKENS = 8
OFFER_WINDOW_S = 1.0
INDEX_LAG_S = 0.5
GRACE_S = 2.5  # offer window + index lag + 1 s
RPC_DEADLINE_S = 1.0
HORIZON_S = GRACE_S + RPC_DEADLINE_S
READ_DELAY_S = 0.5  # P's READ starts half-way into a 1 s window (at the latest 0.25 s before the deadline)


@dataclass
class Engines:
    gateway: GatewayApp
    prefill: SimServer
    decode: SimServer


@contextlib.asynccontextmanager
async def pressure_stack() -> AsyncIterator[Engines]:
    store = MemoryStore()
    gateway = GatewaySettings(
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        hash_secret_hex=SECRET_HEX,
        default_block_size=BLOCK,
        engines_from_registry=True,
        registry_refresh_s=0.2,
        health_interval_s=0.5,
        entry_mirror_stale_after_s=INDEX_LAG_S,
    )
    async with contextlib.AsyncExitStack() as held:
        held.push_async_callback(store.close)
        services = await held.enter_async_context(
            ServiceStack(
                store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5, min_ttl_s=0.1),
                registry=RegistrySettings(port=0, index_max_lag_s=INDEX_LAG_S),
                gateway=gateway,
                server=ServerSettings(shutdown_grace_s=0.2),
                gateway_auth=Authenticator(KEYS),
                stop_grace_s=0.1,
            )
        )
        assert services.gateway is not None and services.registry is not None and services.lease is not None
        config = {
            "kvbridge_registry": services.registry.address,
            "kvbridge_lease": services.lease.address,
            "kvbridge_hash_secret": SECRET_HEX,
            "kvbridge_node_lease_ttl_s": 5,
            "kvbridge_offer_window_s": OFFER_WINDOW_S,
            "kvbridge_index_max_lag_s": INDEX_LAG_S,
            "kvbridge_free_grace_s": GRACE_S,
            "kvbridge_rpc_deadline_s": RPC_DEADLINE_S,
        }
        prefill = SimServer(
            SimConfig(
                role="prefill",
                engine_id="p0",
                model=MODEL,
                block_size=BLOCK,
                prefill_us_per_token=100,
                read_delay_s=READ_DELAY_S,
                kv_load_failure_policy="recompute",
                kvbridge_config=config,
            )
        )
        decode = SimServer(
            SimConfig(
                role="decode",
                engine_id="d0",
                model=MODEL,
                block_size=BLOCK,
                total_blocks=DECODE_BLOCKS,
                admission=True,
                prefix_caching=True,  # as vLLM's D: a next turn shares its conversation's retained blocks
                decode_us_per_token=25_000,
                kvbridge_config=config,
            )
        )
        for sim in (prefill, decode):
            await held.enter_async_context(sim)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while sum(1 for e in services.gateway.core.pool.all() if e.healthy) < 2:
            assert loop.time() < deadline, "the engines never registered"
            await asyncio.sleep(0.05)
        yield Engines(services.gateway, prefill, decode)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(400)}" for _ in range(n))


async def turn(c: httpx.AsyncClient, name: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    r = await c.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "conversation_id": name},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


async def stats(sim: SimServer) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        out: dict[str, Any] = (await c.get(sim.url + "/sim/stats")).json()
        return out


async def test_under_pressure_d_withdraws_in_a_batch_delays_no_admission_and_frees_no_offered_block() -> None:
    rng = random.Random(30)
    async with pressure_stack() as engines:
        d = engines.decode.engine
        assert d.connector is not None
        done: list[tuple[list[dict[str, str]], str]] = []  # every turn's messages and answer
        async with httpx.AsyncClient(
            base_url=engines.gateway.http_url, headers={"authorization": "Bearer key-acme"}, timeout=120
        ) as c:
            calm = {f"calm-{i}": [{"role": "user", "content": words(rng, 100)}] for i in range(CALM)}
            for name, messages in calm.items():  # one after the other: D has slack and retains each
                answer, _ = await turn(c, name, messages)
                done.append((list(messages), answer))
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(rng, 40)}]
            await engines.gateway.core.router.drain()
            deadline = asyncio.get_running_loop().time() + 10
            while d.connector.registered < CALM:  # each retained and registered (its lease bound)
                assert asyncio.get_running_loop().time() < deadline, d.connector.not_retained
                await asyncio.sleep(0.05)
                d.sync_connector()

            async def second(name: str) -> str:
                answer, verdict = await turn(c, name, calm[name])
                done.append((calm[name], answer))
                return verdict

            async def new(name: str, messages: list[dict[str, str]]) -> str:
                answer, verdict = await turn(c, name, messages)
                done.append((messages, answer))
                return verdict

            burst = {f"burst-{i}": [{"role": "user", "content": words(rng, 150)}] for i in range(BURST)}
            verdicts = await asyncio.gather(
                *(second(name) for name in calm), *(new(name, m) for name, m in burst.items())
            )
            await engines.gateway.core.router.drain()
        stats_d, stats_p = await stats(engines.decode), await stats(engines.prefill)
        connector = stats_d["kvbridge"]
        summary = {
            "verdicts": verdicts,
            "admission": stats_d["admission"],
            "d": connector,
            "p_declined": stats_p["kvbridge"]["declined"],
        }
        print("retention under pressure:", summary)

        # The second turns were offered the retained entries, and P read them late in the window (or, its queue
        # past the deadline, declined and computed: the verdict still names the offered tokens).
        assert sum("tokens=0" not in v for v in verdicts[:CALM]) >= CALM // 2, summary
        # Invariant 6: no READ found blocks its request no longer held, though D withdrew those entries meanwhile.
        assert stats_d["unsafe_reads"] == 0, summary
        # Retained KV is a cache: under the burst D withdrew the entries in one batch, and freed finished
        # requests at once instead of retaining them (never registered, never offered: no grace).
        assert max(connector["withdrawal_batches"]) >= 2, summary
        assert sum(connector["not_retained"].values()) > 0, summary
        # No request waited for blocks longer than one horizon (a withdrawal's confirmation and grace), plus the
        # simulator's own turn time: never behind one grace after another.
        assert stats_d["admission"]["wait_max_s"] < HORIZON_S + 1.0, summary

        # Every answer equals the one computed without any reuse (straight to D, no kv_transfer_params).
        wrong = []
        async with httpx.AsyncClient(timeout=60) as plain:
            for messages, answer in done:
                r = await plain.post(
                    engines.decode.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS},
                )
                assert r.status_code == 200, r.text
                if r.json()["choices"][0]["message"]["content"] != answer:
                    wrong.append(messages[0]["content"][:40])
        assert wrong == [], wrong
