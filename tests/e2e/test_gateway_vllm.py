"""The gateway in compatibility mode over real vLLM CPU engines (1P1D, stock NixlConnector, greedy).

Turn 2+ pulls D's KV (P's own remote_prefill_cached_tokens shows it) and answers exactly as the
same conversation sent with reuse disabled. Engines come from the shared ``pd_engines`` fixture.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.e2e.gateway_turns import complete, conversation, prefix_cache_hits
from tests.fixtures.vllm_engines import BLOCK_SIZE, PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "tiny"


async def _gateway(
    pd: PDEngines, *, reuse: bool, placement: bool = False, by_url: bool = False
) -> AsyncIterator[GatewayApp]:
    """``by_url``: the engines given as bare URLs, as a vLLM user first writes them: the gateway learns the rest
    from the engines (model, block size, NIXL identity) and registers them (ADR 0027)."""
    store = MemoryStore()
    # Generous leader TTL and health timeout: the engines spin both cores of a CI machine.
    lease = LeaseApp(store, LeasePolicy(port=0, leader_ttl_s=15, leader_refresh_s=1), ServerSettings())
    await lease.start()
    registry = RegistryApp(store, settings=RegistrySettings(port=0, lease_service_target=lease.address))
    await registry.start()

    def spec(e: object, eid: str, port: int, url: str) -> StaticEngine:
        if by_url:
            return StaticEngine(url=url)
        return StaticEngine(
            url=url,
            model=MODEL,
            engine_id=eid,
            kv_host="127.0.0.1",
            kv_port=port,
            block_size=BLOCK_SIZE,
            register_in_registry=True,
        )

    settings = GatewaySettings(
        http_port=0,
        grpc_port=0,
        registry_address=registry.address,
        lease_address=lease.address,
        hash_secret_hex="ab" * 16,
        default_block_size=BLOCK_SIZE,
        reuse_enabled=reuse,
        placement=placement,
        engines_from_registry=False,
        health_timeout_s=10,
        control_timeout_s=10,
        prefill_engines=[spec(pd.prefill, pd.prefill.engine_id, pd.prefill.side_channel_port, pd.prefill.url)],
        decode_engines=[spec(pd.decode, pd.decode.engine_id, pd.decode.side_channel_port, pd.decode.url)],
    )
    gw = GatewayApp(settings, auth=Authenticator({}))
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()
        await registry.stop(0.1)
        await lease.stop(0.1)
        await store.close()


EDIT_AT = 170  # inside turn 1's 200 prompt tokens, past the first 128-token checkpoint span (not block-aligned)


async def test_gateway_reuses_decode_kv_and_answers_equal_no_reuse(pd_engines: PDEngines) -> None:
    async for gw in _gateway(pd_engines, reuse=True):
        with_reuse = await conversation(gw, "e2e-1", 3)
    async for gw in _gateway(pd_engines, reuse=False):
        without = await conversation(gw, "e2e-2", 3)
    assert with_reuse[0][0].startswith("miss")
    # Correctness holds whatever happened on the reuse path.
    assert [ids for _, ids in with_reuse] == [ids for _, ids in without]
    stalled = [v for v, _ in with_reuse[1:] if v.startswith("declined:prefill_timeout")]
    if stalled:
        # Seen on 2-core CPU hosts: stock vLLM 0.32's NIXL READ on P never completes (bench/results/ttft.md).
        # The gateway timed the pull out and recomputed correctly; the reuse claim is not shown by this run.
        pytest.xfail(f"vLLM's NIXL pull stalled on this host; gateway fell back to recompute: {stalled}")
    assert all(v.startswith("hit;") for v, _ in with_reuse[1:]), with_reuse


async def test_placement_prefills_on_the_holder_d_from_its_prefix_cache_and_answers_equal(
    pd_engines: PDEngines,
) -> None:
    """Placement's local prefill on real vLLM (ADR 0020): turn 2+ goes straight to the D holding the history as a
    plain request with signed params and neither remote flag; vLLM's prefix cache on D serves the history (its
    hits grow by at least the verified tokens), nothing is pulled, D retains the new state (the next turn hits
    again), and the answers equal no reuse."""
    placements: list[str] = []
    hits_before = await prefix_cache_hits(pd_engines.decode.url)
    async for gw in _gateway(pd_engines, reuse=True, placement=True):
        local = await conversation(gw, "e2e-local", 3, placements)
    hits = await prefix_cache_hits(pd_engines.decode.url) - hits_before
    async for gw in _gateway(pd_engines, reuse=False):
        without = await conversation(gw, "e2e-local-2", 3)
    assert [ids for _, ids in local] == [ids for _, ids in without]
    assert local[0][0].startswith("miss"), local[0][0]
    assert placements[1:] == ["prefill_on_holder;reason=cheapest"] * 2, placements
    verified = [int(v.split("tokens=")[1]) for v, _ in local[1:]]
    assert all(v.startswith("hit;") for v, _ in local[1:]), local
    assert all(t >= 200 // BLOCK_SIZE * BLOCK_SIZE for t in verified), verified
    assert hits >= sum(verified), (hits, verified)  # D computed none of the verified history again


async def _edited_and_foreign(gw: GatewayApp) -> list[tuple[str, list[int]]]:
    """Turn 1; turn 2 with token EDIT_AT of the history edited; then an unrelated prompt claiming the same key."""
    rng = random.Random(11)
    prompt = [rng.randrange(10, 500) for _ in range(200)]
    out = []
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=600) as c:
        out.append(await complete(c, gw, prompt, "e2e-edit"))
        edited = prompt + out[0][1] + [rng.randrange(10, 500) for _ in range(20)]
        edited[EDIT_AT] = 9 if edited[EDIT_AT] != 9 else 8
        out.append(await complete(c, gw, edited, "e2e-edit"))
        foreign = [rng.randrange(10, 500) for _ in range(260)]
        out.append(await complete(c, gw, foreign, "e2e-edit"))
    return out


async def test_edited_history_reuses_only_the_verified_prefix_and_a_foreign_prompt_nothing(
    pd_engines: PDEngines,
) -> None:
    async for gw in _gateway(pd_engines, reuse=True):
        with_reuse = await _edited_and_foreign(gw)
    async for gw in _gateway(pd_engines, reuse=False):
        without = await _edited_and_foreign(gw)
    # Same answers as no reuse at all: nobody was fed KV that does not match their prompt.
    assert [ids for _, ids in with_reuse] == [ids for _, ids in without]
    first, edited, foreign = (v for v, _ in with_reuse)
    assert first.startswith("miss"), first
    # The key matches but the prompt shares no verified block with D's entry: no pull.
    assert not foreign.startswith("hit"), foreign
    if edited.startswith("declined:prefill_timeout"):
        pytest.xfail(f"vLLM's NIXL pull stalled on this host; gateway fell back to recompute: {edited}")
    # The blocks before the edit are verified exactly: turn 1's entry (~8 blocks of 32 tokens) lies within
    # the registry's exact tail (chain_exact_tail_blocks, docs/adr/0018); past it the proof would floor
    # to a CHAIN_STRIDE-block checkpoint.
    assert RegistrySettings().chain_exact_tail_blocks >= 16
    assert edited == f"hit;tokens={EDIT_AT // BLOCK_SIZE * BLOCK_SIZE}", edited


async def test_stock_engines_given_by_url_only_reuse_for_a_keyless_sdk_client(pd_engines: PDEngines) -> None:
    """Issue 27: ``KVBRIDGE_GATEWAY_PREFILL_ENGINES=http://p:8000`` and the same for D, nothing else, and the stock
    OpenAI SDK with no conversation key (non-streaming: stock vLLM returns D's retained params only then): from
    the second turn on every turn hits, answers equal to no reuse."""
    rng = random.Random(27)
    words = [f"w{i}" for i in range(300)]

    async def turns(gw: GatewayApp) -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="unused", timeout=600, max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(150))}]
        out = []
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, temperature=0, max_tokens=12
            )
            answer = raw.parse().choices[0].message.content or ""
            out.append((raw.headers.get("x-kvbridge-reuse", ""), answer))
            await gw.core.router.drain()  # compatibility mode registers after the answer
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and w1 w2 w3 then"}]
        return out

    state = rng.getstate()
    async for gw in _gateway(pd_engines, reuse=True, by_url=True):
        with_reuse = await turns(gw)
    rng.setstate(state)
    async for gw in _gateway(pd_engines, reuse=False, by_url=True):
        without = await turns(gw)
    assert [a for _, a in with_reuse] == [a for _, a in without]
    assert with_reuse[0][0].startswith("miss"), with_reuse
    stalled = [v for v, _ in with_reuse[1:] if v.startswith("declined:prefill_timeout")]
    if stalled:
        pytest.xfail(f"vLLM's NIXL pull stalled on this host; gateway fell back to recompute: {stalled}")
    assert all(v.startswith("hit;") for v, _ in with_reuse[1:]), with_reuse
