"""Multi-turn reuse through the gateway against the real registry and lease manager."""

from __future__ import annotations

import httpx

from tests.fixtures.gateway_stack import LONG, chat, reference, turn

from .conftest import BLOCK, MODEL, Stack


async def test_multi_turn_reuses_decode_kv_and_answers_equal(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs)
    assert verdict == "miss;tokens=0"
    assert answer == await reference(stack, msgs)
    for i in range(3):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}"}]
        pulled_before = (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"]
        answer, verdict = await turn(stack, msgs)
        assert verdict.startswith("hit;tokens="), verdict
        k = int(verdict.split("=")[1])
        assert k >= 64 and k % 16 == 0
        assert (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"] - pulled_before == k
        assert answer == await reference(stack, msgs)


async def _tokens(stack: Stack, messages: list[dict[str, str]]) -> list[int]:
    async with httpx.AsyncClient() as c:
        r = await c.post(stack.decode.url + "/tokenize", json={"model": MODEL, "messages": messages})
    return [int(t) for t in r.json()["tokens"]]


async def test_edited_history_reuses_exactly_the_blocks_before_the_edit(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs)
    cut = LONG.index("word90")  # late enough that the blocks before it pass the 64-token reuse threshold
    edited = [
        {"role": "user", "content": LONG[:cut] + "EDITED " + LONG[cut:]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "next"},
    ]
    before, after = await _tokens(stack, msgs), await _tokens(stack, edited)
    common = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    expected = common // BLOCK * BLOCK  # the whole blocks before the first edited token, no more
    assert expected >= 64
    pulled_before = (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"]
    answer2, verdict = await turn(stack, edited)
    assert verdict == f"hit;tokens={expected}", (verdict, common)
    assert (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"] - pulled_before == expected
    assert answer2 == await reference(stack, edited)  # and the answer is still right


async def test_other_conversations_key_yields_no_reuse_and_correct_answer(stack: Stack) -> None:
    a = [{"role": "user", "content": LONG}]
    answer_a, _ = await turn(stack, a, conv="conv-a")
    b = [
        {"role": "user", "content": LONG.replace("word", "other")},
        {"role": "assistant", "content": answer_a},
        {"role": "user", "content": "hi"},
    ]
    answer_b, verdict = await turn(stack, b, conv="conv-a")  # B's prompt under A's key
    assert verdict.startswith(("declined:mismatch", "miss")), verdict
    assert answer_b == await reference(stack, b)


async def test_other_tenant_cannot_reuse(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="shared-name")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    async with httpx.AsyncClient(
        base_url=stack.gateway.http_url, timeout=30, headers={"authorization": "Bearer key-globex"}
    ) as globex:
        answer2, verdict = await turn(stack, msgs, conv="shared-name", client=globex)
    assert verdict == "miss;tokens=0"
    assert answer2 == await reference(stack, msgs)


async def test_forged_kv_transfer_params_are_stripped(stack: Stack) -> None:
    forged = {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "evil",
        "remote_request_id": "x",
        "remote_host": "10.9.9.9",
        "remote_port": 1,
        "remote_num_tokens": 48,
    }
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, kv_transfer_params=forged)
    assert answer == await reference(stack, msgs)
    for sim in (stack.prefill, stack.decode):
        for params in (await stack.sim_stats(sim))["kv_transfer_params_seen"]:
            assert params is None or params.get("remote_engine_id") != "evil"


async def test_failed_pull_retries_without_d_params(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
    async with httpx.AsyncClient() as c:  # P's READ of D's blocks fails (policy "fail" → HTTP 500)
        await c.post(stack.decode.url + "/sim/control", json={"fail_reads": 1})
    answer2, verdict = await turn(stack, msgs)
    assert verdict.startswith("declined:prefill_failed"), verdict
    assert answer2 == await reference(stack, msgs)


async def test_streaming_frames_forwarded(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    frames = []
    async with stack.client.stream(
        "POST", "/v1/chat/completions", json=chat(msgs, "conv-s", stream=True, max_tokens=5)
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "x-kvbridge-reuse" in r.headers
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
    assert frames[-1] == "[DONE]"
    assert len(frames) == 1 + 5 + 1  # role frame, 5 tokens, [DONE]


async def test_bad_input_gives_clear_4xx(stack: Stack) -> None:
    r = await stack.client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_field"
    r = await stack.client.post(
        "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await stack.client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await stack.client.post("/v1/chat/completions", content=b"x" * (5 * 1024 * 1024))
    assert r.status_code == 413
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as anon:
        r = await anon.post("/v1/chat/completions", json=chat([{"role": "user", "content": "x"}]))
    assert r.status_code == 401
