"""Compatibility-mode safety and the turns the hash chain does not cover, through the real registry, lease manager
and engine simulators (stock single-use D: P's read frees the blocks).

Each test asserts the answer equals the same turn computed without reuse, and names the verdict it got."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import StaticEngine
from tests.fixtures.gateway_stack import KEYS, LONG, chat, reference, running_stack, turn
from tests.tools.engine_sim import SimServer

from .conftest import MODEL, Stack

TENANT = "acme"


async def pulls(stack: Stack) -> int:
    return int((await stack.sim_stats(stack.prefill))["remote_pulled_tokens"])


async def entry_epoch(stack: Stack, conv: str, model: str = MODEL) -> int:
    return await stack.gateway.core.control.entry_epoch(tenant=TENANT, model=model, conversation_key=conv)


@contextlib.asynccontextmanager
async def second_replica(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    """Another gateway on the same registry, lease manager and engines (the engines stay registered by the first;
    the second learns nothing from the first but what the registry holds)."""
    s = stack.gateway.core.settings
    unregistered = {"register_in_registry": False}
    settings = s.model_copy(
        update={
            "prefill_engines": [StaticEngine(**{**e.model_dump(), **unregistered}) for e in s.prefill_engines],
            "decode_engines": [StaticEngine(**{**e.model_dump(), **unregistered}) for e in s.decode_engines],
        }
    )
    gw = GatewayApp(settings, auth=Authenticator(KEYS))
    await gw.start()
    try:
        async with httpx.AsyncClient(
            base_url=gw.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30
        ) as client:
            yield client
    finally:
        await gw.core.router.drain()
        await gw.stop()


async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


async def test_two_replicas_pull_one_entry_once(stack: Stack) -> None:
    """One compatibility-mode entry, the same next turn sent to two gateway replicas at once and then again to
    each: exactly one pull of the entry in all; every other turn recomputes; every answer is right."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="r1")
    assert await entry_epoch(stack, "r1") > 0
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    expected = await reference(stack, msgs)
    before = await pulls(stack)
    async with second_replica(stack) as other:
        body = chat(msgs, "r1")
        together = await asyncio.gather(post(stack.client, body), post(other, body))
        await stack.settle()
        again = [await post(other, body), await post(stack.client, body)]
    verdicts = [v for _, v in [*together, *again]]
    assert all(a == expected for a, _ in [*together, *again]), verdicts
    hits = [v for v in verdicts[:2] if v.startswith("hit;")]
    assert len(hits) == 1, verdicts
    loser = next(v for v in verdicts[:2] if not v.startswith("hit;"))
    assert loser.startswith(("declined:consumed", "miss")), loser
    first_pull = int(hits[0].split("=")[1])
    # The repeats find the winner's newer entry (registered after its turn) or nothing: never the consumed one.
    repeats = sum(int(v.split("=")[1]) for v in verdicts[2:] if v.startswith("hit;"))
    assert await pulls(stack) - before == first_pull + repeats


async def test_a_consumed_entry_is_not_offered_again_by_another_replica(stack: Stack) -> None:
    """Replica A pulls the entry; replica B, with no memory of that, is then asked the same turn and must not
    pull the freed blocks (the registry no longer holds the consumed entry)."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="r2", client=stack.client)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    # Non-streaming registration would replace the entry; a streamed turn is not registered (stock vLLM).
    r = await stack.client.post("/v1/chat/completions", json=chat(msgs, "r2", stream=True))
    assert r.status_code == 200 and r.headers["x-kvbridge-reuse"].startswith("hit;"), r.headers
    await stack.settle()
    assert await entry_epoch(stack, "r2") == 0  # consumed: gone from the registry
    before = await pulls(stack)
    async with second_replica(stack) as other:
        answer_b, verdict = await post(other, chat(msgs, "r2"))
    assert verdict == "miss;tokens=0", verdict
    assert await pulls(stack) == before
    assert answer_b == await reference(stack, msgs)


async def test_a_body_field_outside_the_allow_list_declines_reuse(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="f1")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    before = await pulls(stack)
    answer2, verdict = await turn(stack, msgs, conv="f1", truncate_prompt_tokens=100_000)
    assert verdict.startswith("declined:unsupported_field;"), verdict
    assert await pulls(stack) == before
    assert answer2 == await reference(stack, msgs)
    # The turn still registered D's own tokens (its KV is what the chain says): the next plain turn reuses it.
    msgs += [{"role": "assistant", "content": answer2}, {"role": "user", "content": "more"}]
    answer3, verdict = await turn(stack, msgs, conv="f1")
    assert verdict.startswith("hit;"), verdict
    assert answer3 == await reference(stack, msgs)


async def test_a_multimodal_turn_is_declined_and_not_registered(stack: Stack) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": LONG}, image]}]
    for i in range(2):
        r = await stack.client.post("/v1/chat/completions", json=chat(msgs, "mm1"))
        assert r.status_code == 200, r.text
        await stack.settle()
        assert r.headers["x-kvbridge-reuse"] == "declined:multimodal_input;tokens=0"
        assert await entry_epoch(stack, "mm1") == 0  # nothing registered: a same-size image would hash alike
        msgs += [
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"and {i}"},
        ]
    seen = (await stack.sim_stats(stack.decode))["kv_transfer_params_seen"][-1]
    assert seen is not None and not seen.get("kvbridge_conversation_key")  # a connector on D registers nothing


async def test_a_failed_tokenize_declines_reuse(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="t1")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    async with httpx.AsyncClient() as c:
        await c.post(stack.prefill.url + "/sim/control", json={"fail_tokenize": 1})
    answer2, verdict = await turn(stack, msgs, conv="t1")
    assert verdict == "declined:tokenize_failed;tokens=0", verdict
    assert answer2 == await reference(stack, msgs)


async def test_p_recomputing_a_pull_past_ds_deadline_is_named(stack: Stack) -> None:
    """P's params carry D's block deadline on D's clock (learned from D's responses); a P that declines the read
    (here: D's deadline already passed, P set to recompute) answers right and the verdict says recomputed."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="x1")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    answer, verdict = await turn(stack, msgs, conv="x1")
    assert verdict.startswith("hit;"), verdict
    p_params = (await stack.sim_stats(stack.prefill))["kv_transfer_params_seen"][-1]
    deadline = p_params["remote_blocks_expiry_time"]
    assert time.time() < deadline <= time.time() + stack.gateway.core.settings.compat_decoder_kv_blocks_ttl_s
    stack.prefill.cfg.kv_load_failure_policy = "recompute"
    router = stack.gateway.core.router
    router.clocks._by_engine["d0"] -= 10_000.0  # as if D's clock were far behind: the deadline P gets has passed
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    answer, verdict = await turn(stack, msgs, conv="x1")
    assert verdict.startswith("declined:recomputed;"), verdict
    assert answer == await reference(stack, msgs)


async def stored_entry(stack: Stack, conv: str) -> registry_pb2.Entry:
    assert stack.registry is not None
    async with grpc.aio.insecure_channel(stack.registry.address) as channel:
        resp = await registry_pb2_grpc.RegistryServiceStub(channel).GetEntry(
            registry_pb2.GetEntryRequest(key=registry_pb2.EntryKey(tenant=TENANT, model=MODEL, conversation_key=conv)),
            timeout=5,
        )
    return resp.entry


async def test_an_entry_expires_at_ds_hold_and_renewals_do_not_extend_it(stack: Stack) -> None:
    ttl = stack.gateway.core.settings.compat_decoder_kv_blocks_ttl_s
    msgs = [{"role": "user", "content": LONG}]
    sent = time.time()
    await turn(stack, msgs, conv="e1")
    entry = await stored_entry(stack, "e1")
    expire = entry.expire_time.ToNanoseconds() / 1e9
    assert sent + ttl <= expire <= time.time() + ttl  # D's hold: from when the decode request went out
    # A streamed turn (not registered) of the conversation renews its lease; a different prompt, so it pulls
    # nothing and the entry stays. The entry's deadline does not move.
    r = await stack.client.post(
        "/v1/chat/completions",
        json=chat([{"role": "user", "content": LONG.replace("word", "other")}], "e1", stream=True),
    )
    assert r.status_code == 200 and not r.headers["x-kvbridge-reuse"].startswith("hit"), r.headers
    await stack.settle()
    again = await stored_entry(stack, "e1")
    assert again.epoch == entry.epoch and again.expire_time == entry.expire_time


@pytest.fixture
async def lora_stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        for sim in (s.prefill, s.decode):
            sim.cfg.lora_adapters = ("sim-lora",)
        pool = s.gateway.core.pool
        for engine in pool.all():
            engine.models.clear()  # learned again from /v1/models, now listing the adapter
        await pool.check_all()
        yield s


async def test_a_lora_adapter_turn_gets_no_reuse_and_leaves_none(lora_stack: Stack) -> None:
    stack = lora_stack
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs, conv="l1")  # the base model: registered
    assert verdict == "miss;tokens=0"
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    base_epoch = await entry_epoch(stack, "l1")
    before = await pulls(stack)
    r = await stack.client.post("/v1/chat/completions", json={**chat(msgs, "l1"), "model": "sim-lora"})
    assert r.status_code == 200, r.text
    await stack.settle()
    assert r.headers["x-kvbridge-reuse"] == "declined:lora_adapter;tokens=0"
    assert await pulls(stack) == before  # the base model's KV was not loaded for the adapter
    assert await entry_epoch(stack, "l1") == base_epoch  # the adapter's KV was not registered
    assert await entry_epoch(stack, "l1", model="sim-lora") == 0
    seen = (await stack.sim_stats(stack.decode))["kv_transfer_params_seen"][-1]
    assert seen is not None and not seen.get("kvbridge_conversation_key")


async def _until(predicate: Any, timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls the gateway's engine table
            await asyncio.sleep(0.05)


async def test_a_stock_decode_engine_restarted_under_its_id_is_never_read_for_its_old_entries(stack: Stack) -> None:
    """Stock D holds a conversation's blocks, then restarts under the same id, URL and ports with an empty KV
    cache; another conversation's KV fills the block ids the old entry names. The old conversation's next turn
    must not pull them (stock D tells nobody it restarted: the gateway registers it again under a new node lease
    once it saw it down, which retires the old entry), and its answer is the one computed without reuse."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="restart")
    assert await entry_epoch(stack, "restart") > 0
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    engine = stack.gateway.core.pool.find("d0")
    assert engine is not None and engine.record is not None
    first_incarnation = engine.record.node_lease_id

    await stack.decode.__aexit__(None, None, None)
    await _until(lambda: not engine.healthy)
    async with SimServer(dataclasses.replace(stack.decode.cfg)) as restarted:
        await _until(lambda: engine.healthy and not engine.needs_new_incarnation)
        assert engine.record.node_lease_id != first_incarnation
        other = [{"role": "user", "content": LONG.replace("word", "other")}]
        await turn(stack, other, conv="someone-else")  # the restarted D's blocks now hold other KV
        got, verdict = await post(stack.client, chat(msgs, "restart"))
        await stack.settle()  # its registration (on the new incarnation) lands before the next turn looks up
        stats = await stack.sim_stats(restarted)
        assert not verdict.startswith("hit"), verdict
        assert stats["unsafe_reads"] == 0, stats
        assert got == await reference(stack, msgs)
        # The new incarnation serves reuse again.
        msgs += [{"role": "assistant", "content": got}, {"role": "user", "content": "and again"}]
        got, verdict = await post(stack.client, chat(msgs, "restart"))
        assert verdict.startswith("hit"), verdict
        assert got == await reference(stack, msgs)
