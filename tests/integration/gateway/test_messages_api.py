"""The Anthropic Messages API through the gateway with the stock Anthropic SDK: x-api-key and Bearer, a
tool_use / tool_result history that reuses, streaming events, errors in Anthropic's shape."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.fixtures.gateway_stack import LONG, reference

from .conftest import BLOCK, MODEL, Stack

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "cache_control": {"type": "ephemeral"},
}
SESSION = {"X-Session-ID": "claude-1"}


def _expected_hit(usage: Any) -> str:
    return f"hit;tokens={(usage.input_tokens + usage.output_tokens) // BLOCK * BLOCK}"


@pytest.mark.parametrize("session", [SESSION, {}], ids=["keyed", "keyless"])
async def test_tool_history_reuses_non_streaming_and_streaming(stack: Stack, session: dict[str, str]) -> None:
    """With a session key, and without any key (a keyless thread, ADR 0022): the same exact hits."""
    client = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, api_key="key-acme", max_retries=0)
    system: Any = [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]
    messages: list[Any] = [{"role": "user", "content": LONG}]
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=6, system=system, messages=messages, tools=[WEATHER], extra_headers=session
    )
    first = await raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == "miss;tokens=0"
    chat: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
    text = await reference(stack, chat, max_tokens=6)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert [b.type for b in first.content] == ["text"]
    assert first.content[0].type == "text" and first.content[0].text == text
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 6
    await stack.settle()

    # The agent called a tool in that turn (as a client would record it) and sends its result.
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": text},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=8, system=system, messages=messages, tools=[WEATHER], extra_headers=session
    )
    second = await raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == _expected_hit(first.usage)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat += [
        {"role": "assistant", "content": text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    text2 = await reference(stack, chat)
    assert second.content[0].type == "text" and second.content[0].text == text2
    await stack.settle()

    # A streamed third turn, with Bearer instead of x-api-key.
    bearer = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, auth_token="key-acme", max_retries=0)
    messages += [{"role": "assistant", "content": text2}, {"role": "user", "content": "and then?"}]
    chat += [{"role": "assistant", "content": text2}, {"role": "user", "content": "and then?"}]
    async with bearer.messages.stream(
        model=MODEL, max_tokens=8, system=system, messages=messages, tools=[WEATHER], extra_headers=session
    ) as stream:
        assert stream.response.headers["x-kvbridge-reuse"] == _expected_hit(second.usage)
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text" and final.content[0].text == await reference(stack, chat)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    await client.close()
    await bearer.close()


async def test_errors_in_anthropic_shape(stack: Stack) -> None:
    nokey = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await nokey.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "unknown API key"},
    }
    await nokey.close()
    client = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, api_key="key-acme", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    await client.close()


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        {"model": MODEL, "max_tokens": 4, "messages": []},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "system": 5},
        {"model": MODEL, "max_tokens": 4, "messages": "hi"},
    ],
)
async def test_bad_input_is_400(stack: Stack, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers={"x-api-key": "key-acme"}) as c:
        r = await c.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]
