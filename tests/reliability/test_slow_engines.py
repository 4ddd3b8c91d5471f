"""Slow and hung engines (engine simulator ``stall_s``): the gateway answers within its deadlines.

- a hung prefill engine (one of two): each turn ends within the prefill deadline (twice, for a reuse
  attempt then a plain one on the other engine) plus slack, with a 200 or a clean 5xx carrying an error
  code; answers that come back are correct; after its first timeout the hung engine gets no more turns;
- a hung decode engine: a non-streaming turn gets a clean timeout error (504 DEADLINE_EXCEEDED or 503
  UPSTREAM_FAILED) after the decode deadline, a streaming one an SSE error event and no [DONE]; no entry
  lease or registry entry is left for the failed turn;
- a slow decode engine (one of two) does not hold up conversations served by the other.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvbridge.errors import NotFound
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.engines import PREFILL

from .conftest import MODEL, call
from .simstack import LONG, Stack

pytestmark = [pytest.mark.slow]
DEADLINE_S = 2.0
SLACK_S = 5.0  # generous: a shared 2-core machine


def _body(msgs: list[dict[str, str]], conv: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "messages": msgs, "max_tokens": 8, "conversation_id": conv, "stream": stream}


def _error_code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


async def test_hung_prefill_engine_turns_end_within_the_deadline() -> None:
    store = MemoryStore()
    async with Stack(store, prefills=2, prefill_timeout_s=DEADLINE_S) as stack:
        msgs = [{"role": "user", "content": LONG}]
        # The engine the pool would pick next accepts requests and never answers.
        first_choice = stack.gateway.core.pool.choose(MODEL, PREFILL).url
        hung = next(sim for sim in stack.prefill_sims if sim.url == first_choice)
        hung.cfg.stall_s = 120.0
        outcomes: list[tuple[int, str, float]] = []
        wrong = 0
        for t in range(6):
            started = time.monotonic()
            r = await stack.client.post("/v1/chat/completions", json=_body(msgs, "c-hung-p"))
            took = time.monotonic() - started
            await stack.gateway.core.router.drain()
            if r.status_code == 200:
                answer = str(r.json()["choices"][0]["message"]["content"])
                wrong += answer != await stack.reference(msgs)
                outcomes.append((200, r.headers["x-kvbridge-reuse"], took))
                msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": f"t{t}"}]
            else:
                outcomes.append((r.status_code, _error_code(r), took))
        stalled = (await httpx.AsyncClient().get(hung.url + "/sim/stats")).json()["stalled"]
        print(
            f"\nhung prefill (1 of 2 P, deadline {DEADLINE_S}s): outcomes {outcomes}; the hung one stalled {stalled} "
            f"requests; wrong answers {wrong}"
        )
        assert stalled > 0  # the hung engine was really tried
        # ... and then ejected: it answers /health, but after a timeout it gets no new turns for a while.
        assert stalled <= 2, f"{stalled} requests went to the hung prefill engine"
        assert wrong == 0
        for status, code, took in outcomes:
            assert took <= 2 * DEADLINE_S + SLACK_S, outcomes
            assert status == 200 or (status in (502, 503, 504) and code), outcomes
        assert sum(status == 200 for status, _, _ in outcomes) >= 3, outcomes  # the other P serves
    await store.close()


async def _leases_and_entry(stack: Stack, conv: str) -> tuple[int, bool]:
    leases = await call(stack.lease_stub.ListLeases, lease_pb2.ListLeasesRequest(page_size=1000), None)
    try:
        await call(
            stack.registry_stub.GetEntry,
            registry_pb2.GetEntryRequest(
                key=registry_pb2.EntryKey(tenant="default", model=MODEL, conversation_key=conv)
            ),
            None,
        )
        has_entry = True
    except NotFound:
        has_entry = False
    return len(leases.leases), has_entry


@pytest.mark.parametrize("stream", [False, True])
async def test_hung_decode_engine_gives_a_clean_timeout(stream: bool) -> None:
    store = MemoryStore()
    async with Stack(store, decode_timeout_s=DEADLINE_S) as stack:
        msgs = [{"role": "user", "content": LONG}]
        leases_before, _ = await _leases_and_entry(stack, "c-hung-d")
        stack.decode[0].cfg.stall_s, stack.decode[0].cfg.stall_after_tokens = 120.0, 2  # stuck after 2 tokens
        started = time.monotonic()
        if stream:
            async with stack.client.stream(
                "POST", "/v1/chat/completions", json=_body(msgs, "c-hung-d", stream=True)
            ) as r:
                status = r.status_code
                frames = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            took = time.monotonic() - started
            print(f"\nhung decode (stream): HTTP {status} after {took:.2f}s, last frame {frames[-1:]}")
            assert status == 200 and frames, frames  # headers were sent before the stall ...
            assert frames[-1] != "data: [DONE]", frames  # ... so the end is an error event, not a clean finish
            assert "error" in json.loads(frames[-1].removeprefix("data: ")), frames[-1]
        else:
            r = await stack.client.post("/v1/chat/completions", json=_body(msgs, "c-hung-d"))
            took = time.monotonic() - started
            print(f"\nhung decode: HTTP {r.status_code} {r.text[:200]} after {took:.2f}s")
            assert r.status_code in (503, 504), r.text
            assert _error_code(r) in ("deadline_exceeded", "upstream_failed", "upstream_timeout"), r.text
        assert took <= DEADLINE_S + SLACK_S
        await stack.gateway.core.router.drain()
        leases_after, has_entry = await _leases_and_entry(stack, "c-hung-d")
        assert leases_after == leases_before and not has_entry  # nothing registered or leased for the failed turn
    await store.close()


async def test_slow_decode_engine_does_not_block_other_conversations() -> None:
    store = MemoryStore()
    async with Stack(store, decodes=2) as stack:
        slow_s = 4.0
        msgs, _ = await _turn(stack, [{"role": "user", "content": LONG}], "c-slow")
        slow = next(d for d in stack.decode if d.engine.kv.held)  # the D holding c-slow's KV
        slow.cfg.stall_s = slow_s

        async def timed(history: list[dict[str, str]], conv: str) -> tuple[float, str, float]:
            started = time.monotonic()
            _, verdict = await _turn(stack, history, conv)
            return time.monotonic() - started, verdict, time.monotonic()

        # c-slow's next turn reuses its KV on the slow engine; six new conversations start meanwhile.
        slow_task = asyncio.create_task(timed(msgs, "c-slow"))
        await asyncio.sleep(0.2)
        others = await asyncio.gather(
            *(timed([{"role": "user", "content": f"{LONG} q{i}"}], f"c-new-{i}") for i in range(6))
        )
        slow_took, slow_verdict, slow_done_at = await slow_task
        stalled = slow.engine.stats.stalled
        print(
            f"\nslow decode (1 of 2 D, {slow_s}s per answer): its conversation's turn took {slow_took:.2f}s "
            f"({slow_verdict}); 6 new conversations took {sorted(round(t, 2) for t, _, _ in others)} s; "
            f"{stalled} turns stalled on the slow engine"
        )
        assert slow_verdict.startswith("hit") and slow_took >= slow_s  # really served by the slow engine
        quick = [done for took, _, done in others if took < slow_s / 2]
        assert len(quick) >= 6 - (stalled - 1), others  # every new turn not on the slow engine was quick ...
        assert max(quick) < slow_done_at  # ... and done while the slow one was still being answered
    await store.close()


async def _turn(stack: Stack, msgs: list[dict[str, str]], conv: str) -> tuple[list[dict[str, str]], str]:
    r = await stack.client.post("/v1/chat/completions", json=_body(msgs, conv))
    assert r.status_code == 200, r.text
    answer = str(r.json()["choices"][0]["message"]["content"])
    await stack.gateway.core.router.drain()
    return [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}], r.headers[
        "x-kvbridge-reuse"
    ]
