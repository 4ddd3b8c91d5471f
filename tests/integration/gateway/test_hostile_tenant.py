"""What one tenant's requests may cost the gateway and reveal in its log (issue 30, item 8): a text prompt past
max_prompt_tokens is refused once tokenized, before it is hashed or sent to an engine; the INFO line of each turn
names the conversation by a keyed hash, never by its key."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from tests.fixtures.gateway_stack import LONG, Stack, chat, running_stack


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        yield s


@pytest.mark.parametrize("route,body", [("chat", "messages"), ("completions", "prompt")])
async def test_a_text_prompt_past_max_prompt_tokens_is_refused_once_tokenized(
    stack: Stack, route: str, body: str
) -> None:
    # LONG: ~120 tokens and ~1,000 characters, within the character bound set at start (1M tokens x 16).
    stack.gateway.core.settings.max_prompt_tokens = 100
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    requests_before = stack.prefill.engine.stats.requests
    payload = chat([{"role": "user", "content": LONG}], conv=None)  # keyless: tokenized before P
    if route == "completions":
        payload = {"model": payload["model"], "prompt": LONG, "max_tokens": 4}
    r = await stack.client.post(path, json=payload)
    assert r.status_code == 413, r.text  # TOO_LARGE, as a token-id prompt past the limit
    error = r.json()["error"]
    assert error["code"] == "too_large" and error["param"] == body, error
    assert "more than max_prompt_tokens (100)" in error["message"]
    assert stack.prefill.engine.stats.requests == requests_before  # no prefill (P's /tokenize only)
    stack.gateway.core.settings.max_prompt_tokens = 1_000  # the same prompt within the limit: served
    r = await stack.client.post(path, json=payload)
    assert r.status_code == 200, r.text


async def test_the_turn_log_line_names_the_conversation_by_a_keyed_hash(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    key = "acme-secret-conversation-key-0042"
    with caplog.at_level(logging.INFO, logger="kvbridge_services.gateway.router"):
        r = await stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}], key))
        assert r.status_code == 200, r.text
        await stack.settle()
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("turn tenant=acme")]
    assert len(lines) == 1, caplog.text
    assert key not in caplog.text
    hashed = stack.gateway.core.router._telemetry.hash(key)
    assert f"key={hashed} " in lines[0] and len(hashed) == 16
