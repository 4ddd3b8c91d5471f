"""An agent whose tool answers at once: its next turn arrives before the previous turn's registration has
landed (compatibility mode registers after the answer; a connector registers off the engine's loop). The
gateway waits for that registration, bounded by registration_wait_s, instead of recomputing the history."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fixtures.gateway_stack import LONG, chat, reference

from .conftest import Stack

REGISTRATION_DELAY_S = 0.2  # the registry write lands this long after the answer (a busy control plane)


@pytest.fixture
def slow_registrations(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    control = stack.gateway.core.router._registrar._control
    register_entry = control.register_entry

    async def late(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(REGISTRATION_DELAY_S)
        return await register_entry(*args, **kwargs)

    monkeypatch.setattr(control, "register_entry", late)


async def _turn_at_once(stack: Stack, messages: list[dict[str, str]]) -> tuple[str, str]:
    """One turn, and no waiting for its post-turn work (unlike gateway_stack.turn)."""
    r = await stack.client.post("/v1/chat/completions", json=chat(messages, "conv-fast"))
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


async def test_a_turn_sent_the_moment_the_previous_one_answered_still_reuses(
    stack: Stack, slow_registrations: None
) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await _turn_at_once(stack, msgs)
    assert verdict == "miss;tokens=0"
    for i in range(3):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"tool said {i}"}]
        answer, verdict = await _turn_at_once(stack, msgs)
        assert verdict.startswith("hit;tokens="), (i, verdict)
        assert answer == await reference(stack, msgs)
    waits = stack.gateway.core.metrics.registration_waits.labels("yes")
    assert waits._sum.get() >= 3 * REGISTRATION_DELAY_S * 0.5  # the lookups did wait for the registrations


async def test_without_the_wait_that_turn_recomputes(stack: Stack, slow_registrations: None) -> None:
    """The same conversation with registration_wait_s 0: what the wait is for (a miss, the history recomputed)."""
    router = stack.gateway.core.router
    router._s = router._s.model_copy(update={"registration_wait_s": 0.0})
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await _turn_at_once(stack, msgs)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "tool said 0"}]
    _, verdict = await _turn_at_once(stack, msgs)
    assert verdict.startswith("miss"), verdict
