"""Placement through the gateway (docs/gateway.md "Placement"): simulators at 2P2D and 4P4D with vLLM's prefix
cache modelled, the real registry and lease manager, compatibility mode.

A conversation's turns decode on the D that holds it, which then pulls only the new suffix from P; or they go
straight to it as a local prefill (no P, no transfer); an overloaded or unhealthy holder sends the turn
elsewhere; every answer equals the answer computed with no reuse at all.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvbridge_services.gateway.engines import DECODE
from tests.fixtures.pd_pool import POOL_BLOCK, Pool, running_pool

HISTORY = " ".join(f"word{i}" for i in range(150))  # ~150 tokens


async def _requests(pool: Pool) -> dict[str, int]:
    return {s.engine.engine_id: int((await pool.stats(s))["requests"]) for s in (*pool.prefills, *pool.decodes)}


async def _stats(pool: Pool) -> dict[str, dict[str, Any]]:
    return {s.engine.engine_id: await pool.stats(s) for s in (*pool.prefills, *pool.decodes)}


def _delta(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]], field: str) -> dict[str, int]:
    return {e: int(after[e][field]) - int(before[e][field]) for e in after}


async def _next_turn(pool: Pool, msgs: list[dict[str, str]], conv: str, content: str) -> tuple[str, httpx.Headers]:
    """Appends the user's ``content`` and runs the turn; its answer must equal the answer with no reuse."""
    msgs.append({"role": "user", "content": content})
    answer, headers = await pool.turn(msgs, conv)
    assert answer == await pool.reference(msgs), headers
    return answer, headers


async def _first_turn(pool: Pool, conv: str) -> tuple[list[dict[str, str]], str]:
    """Turn 1 of a conversation, and the D that served it (the holder from then on)."""
    before = await _requests(pool)
    msgs = [{"role": "user", "content": f"{conv} {HISTORY}"}]
    answer, headers = await pool.turn(msgs, conv)
    assert headers["x-kvbridge-reuse"] == "miss;tokens=0"
    assert headers["x-kvbridge-placement"] == "recompute;reason=no_history"
    assert answer == await pool.reference(msgs)
    after = await _requests(pool)
    (holder,) = [e for e in after if e.startswith("d") and after[e] > before[e]]
    return [*msgs, {"role": "assistant", "content": answer}], holder


async def test_turns_decode_on_the_holder_which_pulls_only_the_suffix() -> None:
    async with running_pool(2, 2, gateway={"placement_local_prefill": False}) as pool:
        msgs, holder = await _first_turn(pool, "conv-h")
        for i in range(3):
            before = await _stats(pool)
            answer, headers = await _next_turn(pool, msgs, "conv-h", f"then step {i} " * 3)
            after = await _stats(pool)
            placed = (headers["x-kvbridge-placement"], headers["x-kvbridge-reuse"])
            assert placed[0] in {"recompute;reason=cheapest", "pull_to_p;reason=cheapest"}, placed
            served = _delta(after, before, "requests")
            assert served[holder] == 1 and sum(v for e, v in served.items() if e.startswith("d")) == 1, placed
            # D's prefix cache held the history (whole blocks): it pulled only the suffix after it from P.
            hit = _delta(after, before, "local_hit_tokens")[holder]
            pulled = _delta(after, before, "remote_pulled_tokens")[holder]
            assert hit > 150 and hit % POOL_BLOCK == 0, (hit, placed)
            assert 0 < pulled < 3 * POOL_BLOCK, (pulled, placed)  # the new message and the last partial block
            assert _delta(after, before, "computed_tokens")[holder] == 0
            msgs.append({"role": "assistant", "content": answer})


async def test_a_turn_prefills_on_the_holder_with_no_p_and_no_transfer() -> None:
    async with running_pool(2, 2) as pool:
        msgs, holder = await _first_turn(pool, "conv-l")
        for i in range(3):
            before = await _stats(pool)
            answer, headers = await _next_turn(pool, msgs, "conv-l", f"and now {i} please")
            after = await _stats(pool)
            assert headers["x-kvbridge-placement"] == "prefill_on_holder;reason=cheapest"
            reuse, tokens = headers["x-kvbridge-reuse"].split(";tokens=")
            assert reuse == "hit" and int(tokens) > 150 and int(tokens) % POOL_BLOCK == 0
            served = _delta(after, before, "requests")
            assert served == {e: int(e == holder) for e in served}  # no P at all
            assert not any(_delta(after, before, "remote_pulled_tokens").values())  # nothing moved
            hit = _delta(after, before, "local_hit_tokens")[holder]
            computed = _delta(after, before, "computed_tokens")[holder]
            assert hit >= int(tokens) and computed < 2 * POOL_BLOCK  # only the new suffix was prefilled
            msgs.append({"role": "assistant", "content": answer})
        metrics = (await pool.client.get("/metrics")).text
        assert 'kvbridge_gateway_placement_total{choice="prefill_on_holder",reason="cheapest"} 3.0' in metrics


async def test_a_streamed_turn_prefills_on_the_holder_and_streams_every_frame() -> None:
    async with running_pool(2, 2) as pool:
        msgs, holder = await _first_turn(pool, "conv-st")
        msgs.append({"role": "user", "content": "stream it"})
        body = {"model": "sim-model", "messages": msgs, "max_tokens": 5, "stream": True, "conversation_id": "conv-st"}
        before = await _requests(pool)
        async with pool.client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            headers = r.headers
            frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert headers["x-kvbridge-placement"] == "prefill_on_holder;reason=cheapest"
        assert headers["x-kvbridge-reuse"].startswith("hit;tokens=")
        assert frames[-1] == "[DONE]" and len(frames) == 1 + 5 + 1
        after = await _requests(pool)
        assert {e: after[e] - before[e] for e in after} == {e: int(e == holder) for e in after}


async def test_an_overloaded_holder_sends_the_turn_elsewhere() -> None:
    async with running_pool(2, 2, gateway={"placement_holder_max_extra_load": 1.0}) as pool:
        msgs, holder = await _first_turn(pool, "conv-o")
        state = pool.gateway.core.pool.find_role(holder, DECODE)
        assert state is not None
        state.outstanding += 3  # as the gateway sees it: three more requests in flight than the other D
        try:
            before = await _requests(pool)
            _, headers = await _next_turn(pool, msgs, "conv-o", "what next")
            after = await _requests(pool)
        finally:
            state.outstanding -= 3
        choice, reason = headers["x-kvbridge-placement"].split(";reason=")
        assert reason == "holder_overloaded" and choice in {"recompute", "pull_to_p"}
        (other,) = [e for e in after if e.startswith("d") and e != holder]
        assert after[other] == before[other] + 1 and after[holder] == before[holder]


async def test_an_unhealthy_holder_sends_the_turn_elsewhere() -> None:
    async with running_pool(2, 2) as pool:
        msgs, holder = await _first_turn(pool, "conv-u")
        await pool.control(pool.sim(holder), healthy=False)
        state = pool.gateway.core.pool.find_role(holder, DECODE)
        assert state is not None
        for _ in range(100):  # the next health check
            if not state.healthy:
                break
            await asyncio.sleep(0.05)
        before = await _requests(pool)
        _, headers = await _next_turn(pool, msgs, "conv-u", "still there?")
        assert (await _requests(pool))[holder] == before[holder]
        assert headers["x-kvbridge-reuse"].startswith("declined:engine_unhealthy")
        assert headers["x-kvbridge-placement"] == "recompute;reason=no_history"


async def test_a_failed_local_prefill_is_recomputed_through_p() -> None:
    async with running_pool(2, 2) as pool:
        msgs, holder = await _first_turn(pool, "conv-f")
        await pool.control(pool.sim(holder), fail_next=1)
        _, headers = await _next_turn(pool, msgs, "conv-f", "again")
        assert headers["x-kvbridge-reuse"].startswith("declined:local_prefill_failed;tokens=")
        assert headers["x-kvbridge-placement"] == "recompute;reason=holder_unavailable"


async def test_a_slow_link_recomputes_on_p_and_still_decodes_on_the_holder() -> None:
    gateway = {"placement_local_prefill": False, "placement_pull_bytes_per_s": 1e6, "placement_pull_fixed_s": 0.5}
    async with running_pool(2, 2, gateway=gateway) as pool:
        msgs, holder = await _first_turn(pool, "conv-s")
        before = await _stats(pool)
        _, headers = await _next_turn(pool, msgs, "conv-s", "more")
        after = await _stats(pool)
        assert headers["x-kvbridge-reuse"].startswith("declined:recompute_cheaper;tokens=")
        assert headers["x-kvbridge-placement"] == "recompute;reason=cheapest"
        assert _delta(after, before, "requests")[holder] == 1
        assert not any(v for e, v in _delta(after, before, "remote_pulled_tokens").items() if e.startswith("p"))


async def test_4p4d_concurrent_conversations_stick_to_their_holders_and_answer_right() -> None:
    async with running_pool(4, 4) as pool:

        async def conversation(conv: str) -> list[str]:
            msgs, _ = await _first_turn(pool, conv)
            placements = []
            for i in range(3):
                answer, headers = await _next_turn(pool, msgs, conv, f"{conv} question {i}")
                placements.append(headers["x-kvbridge-placement"])
                msgs.append({"role": "assistant", "content": answer})
            return placements

        results = await asyncio.gather(*(conversation(f"conv-{i}") for i in range(4)))
        # "cheapest": the holder was eligible and within the load cap, so every option ran on it (it holds the
        # history: fewer tokens to move than on any other D for the same choice).
        assert all(p.endswith(";reason=cheapest") for r in results for p in r), results
        chosen = [p.split(";")[0] for r in results for p in r]
        assert chosen.count("prefill_on_holder") >= len(chosen) // 2, results
        total = await _stats(pool)
        to_d = sum(int(s["remote_pulled_tokens"]) for e, s in total.items() if e.startswith("d"))
        assert to_d < 4 * 150 + 12 * 3 * POOL_BLOCK  # D pulled the first prompts, then suffixes only
