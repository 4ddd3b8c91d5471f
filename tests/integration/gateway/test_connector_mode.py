"""Connector mode without vLLM: the engines run the kvbridge connector's control plane (tests/tools/sim_connector.py)
and register themselves and D's entries; the gateway neither registers entries nor consumes them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.fixtures.gateway_stack import LONG, MODEL, Stack, reference, running_stack, turn


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack(connector_mode=True) as s:
        yield s


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_turns_reuse_what_ds_connector_registered_and_answers_stay_equal(stack: Stack) -> None:
    d = stack.decode.engine
    assert d.connector is not None and stack.prefill.engine.connector is not None
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs)
    assert verdict == "miss;tokens=0"
    for i in range(3):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}"}]
        pulled_before = (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"]
        answer, verdict = await turn(stack, msgs)
        assert verdict.startswith("hit;tokens="), verdict
        k = int(verdict.split("=")[1])
        assert k >= 64 and k % 16 == 0
        assert (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"] - pulled_before == k
        assert answer == await reference(stack, msgs)
    metrics = (await stack.client.get("/metrics")).text
    assert _metric(metrics, "kvbridge_gateway_compat_registrations_total") == 0  # not even a skipped one
    # D was asked for no token ids (the gateway registers nothing): its requests never carried return_token_ids.
    assert not any(body.get("return_token_ids") for body in d.stats.bodies_seen)
    assert stack.prefill.engine.connector.declined == {}
    # D's connector registered all four turns and holds the blocks by reference (P's reads freed nothing). Each
    # superseded entry's lease ended, and its blocks go free_grace_s (2 s here) after that: then only the last
    # turn's entry is still held.
    deadline = time.monotonic() + 10
    while True:
        d.sync_connector()
        if d.connector.registered == 4 and len(d.kv.held) == 1:
            break
        assert time.monotonic() < deadline, (d.connector.registered, list(d.kv.held))
        await asyncio.sleep(0.1)
    assert all(h.multi_use for h in d.kv.held.values())
    assert (await stack.sim_stats(stack.decode))["unsafe_reads"] == 0


async def test_p_declines_an_offer_no_gateway_signed_and_computes_instead(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    await turn(stack, msgs)
    d = stack.decode.engine
    request_id, held = next(iter(d.kv.held.items()))
    forged = {
        "do_remote_decode": True,
        "remote_engine_id": d.engine_id,
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": stack.decode.cfg.port,
        "remote_block_ids": [held.block_ids[:4]],
        "remote_num_tokens": 64,
    }
    async with httpx.AsyncClient() as c:
        r = await c.post(
            stack.prefill.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": msgs, "max_tokens": 1, "kv_transfer_params": forged},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing pulled
    assert stack.prefill.engine.connector is not None
    assert stack.prefill.engine.connector.declined == {"unsigned_offer": 1}
