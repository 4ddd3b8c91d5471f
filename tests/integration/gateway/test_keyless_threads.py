"""Keyless threads (ADR 0022): a client that sends its whole history and no conversation key reuses its KV, in
compatibility mode (the gateway registers) and connector mode (D's connector registers), with the same
verification and tenant scope as a keyed turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from kvbridge_services.gateway.threads import THREAD_KEY_PREFIX, RecentThreads
from tests.fixtures.gateway_stack import LONG, Stack, reference, running_stack, turn


@pytest.fixture(params=["compat", "connector"])
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    async with running_stack(connector_mode=request.param == "connector") as s:
        yield s


def _hit_tokens(verdict: str) -> int:
    assert verdict.startswith("hit;tokens="), verdict
    return int(verdict.split("=")[1])


def _keys(stack: Stack, tenant: str = "acme") -> set[str]:
    assert stack.registry is not None
    return {
        item.entry.key.conversation_key
        for item in stack.registry.index.entries.values()
        if item.entry.key.tenant == tenant
    }


async def _thread_keys(stack: Stack, count: int, tenant: str = "acme") -> set[str]:
    """The tenant's live keyless-thread keys in the registry once there are ``count`` (D's connector registers
    after the turn, off the gateway's path), or fails after 10 s."""
    await stack.settle()
    deadline = time.monotonic() + 10
    while True:
        keys = {k for k in _keys(stack, tenant) if k.startswith(THREAD_KEY_PREFIX)}
        if len(keys) == count:
            return keys
        assert time.monotonic() < deadline, keys
        await asyncio.sleep(0.05)


async def _keyless(
    stack: Stack, msgs: list[dict[str, str]], client: httpx.AsyncClient | None = None
) -> tuple[str, str]:
    answer, verdict = await turn(stack, msgs, conv=None, client=client)
    return answer, verdict


async def test_a_keyless_client_hits_every_later_turn_and_answers_stay_equal(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await _keyless(stack, msgs)
    assert verdict == "miss;tokens=0"
    previous = 0
    for i in range(3):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}"}]
        pulled_before = (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"]
        answer, verdict = await _keyless(stack, msgs)
        k = _hit_tokens(verdict)
        assert k > previous and k % 16 == 0  # each turn reuses more: the previous turn's whole verified history
        previous = k
        assert (await stack.sim_stats(stack.prefill))["remote_pulled_tokens"] - pulled_before == k
        assert answer == await reference(stack, msgs)
    # One thread: each turn's entry superseded the one before (a continuation, not a fork).
    await _thread_keys(stack, 1)


async def test_interleaved_keyless_conversations_each_reuse_their_own(stack: Stack) -> None:
    threads = [[{"role": "user", "content": LONG.replace("word", f"c{c}w")}] for c in range(3)]
    answers = [(await _keyless(stack, t))[0] for t in threads]
    for i in range(2):
        for c, t in enumerate(threads):
            t += [{"role": "assistant", "content": answers[c]}, {"role": "user", "content": f"next {i}"}]
            answers[c], verdict = await _keyless(stack, t)
            assert _hit_tokens(verdict) >= len(LONG.split()) // 16 * 16 - 16
            assert answers[c] == await reference(stack, t)
    await _thread_keys(stack, 3)


async def test_forks_of_one_history_keep_both_and_each_reuses_its_own(stack: Stack) -> None:
    # Long enough to pass a content checkpoint (the registry indexes every 16th block of an entry, and its last):
    # a content lookup finds an entry that a prompt diverges from through the deepest checkpoint they share.
    history = " ".join([LONG, LONG.replace("word", "more"), LONG.replace("word", "yet")])
    base = [{"role": "user", "content": history}]
    answer, _ = await _keyless(stack, base)
    forks = [
        [*base, {"role": "assistant", "content": answer}, {"role": "user", "content": q * 40}] for q in ("A ", "B ")
    ]
    fork_answers = []
    for f in forks:
        a, verdict = await _keyless(stack, f)
        _hit_tokens(verdict)
        assert a == await reference(stack, f)
        fork_answers.append(a)
    # The first fork continued the thread; the second shares only part of its (newer) history: a new thread.
    # Both keep their KV with D's connector (multi-use holds); a stock D frees what P read once, so in
    # compatibility mode the second fork's pull consumed the first's single-use entry.
    await _thread_keys(stack, 2 if stack.decode.engine.connector is not None else 1)
    # Each fork's next turn reuses its own history, longer than what the two share (in compatibility mode only
    # the second fork still has an entry).
    kept = 2 if stack.decode.engine.connector is not None else 1
    for f, a in list(zip(forks, fork_answers, strict=True))[-kept:]:
        f += [{"role": "assistant", "content": a}, {"role": "user", "content": "go on"}]
        answer2, verdict = await _keyless(stack, f)
        assert _hit_tokens(verdict) > len(history.split()) // 16 * 16
        assert answer2 == await reference(stack, f)


async def test_another_tenant_with_the_same_content_never_hits(stack: Stack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await _keyless(stack, msgs)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    async with httpx.AsyncClient(
        base_url=stack.gateway.http_url, timeout=30, headers={"authorization": "Bearer key-globex"}
    ) as globex:
        answer2, verdict = await _keyless(stack, msgs, client=globex)
    assert verdict == "miss;tokens=0"
    assert answer2 == await reference(stack, msgs)


async def test_a_gateway_that_never_saw_the_thread_continues_it_by_content(stack: Stack) -> None:
    """Another replica (here: this gateway with its recent threads forgotten) finds the thread in the registry
    and continues it: the same key, the previous entry superseded."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await _keyless(stack, msgs)
    keys_before = await _thread_keys(stack, 1)
    router = stack.gateway.core.router
    router._threads = RecentThreads(router._chains)  # a replica that served no turn of it
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    answer2, verdict = await _keyless(stack, msgs)
    _hit_tokens(verdict)
    assert answer2 == await reference(stack, msgs)
    await asyncio.sleep(0.5)  # D's connector registers after the turn: give a wrong new key time to show
    assert await _thread_keys(stack, 1) == keys_before


async def test_keyed_turns_are_not_taken_over_by_keyless_ones(stack: Stack) -> None:
    """A keyless turn may reuse a keyed conversation's blocks (same tenant, verified), but registers under a
    thread of its own: it never supersedes the keyed conversation's entry."""
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(stack, msgs, conv="keyed")
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    _, verdict = await _keyless(stack, msgs)
    _hit_tokens(verdict)
    await _thread_keys(stack, 1)
    assert "keyed" in _keys(stack) or stack.decode.engine.connector is None  # a stock D's entry was read once
