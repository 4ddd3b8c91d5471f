"""Errors in each API's own shape on the HTTP door (issue 31), seen through the stock OpenAI SDK and raw HTTP:
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on chat, completions, the Responses API and models
(engines' errors translated into it, the router's 404 and 405 too), the Anthropic shape on the Messages API, the
mid-stream error event; ``/health``; ``usage.prompt_tokens_details.cached_tokens`` = the tokens reused."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.fixtures.gateway_stack import LONG

from .conftest import MODEL, Stack

OPENAI_KEYS = {"message", "type", "param", "code"}


def _sdk(stack: Stack, key: str = "key-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key=key, max_retries=0)


def _openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"] == "application/json", r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_KEYS, body
    error: dict[str, Any] = body["error"]
    return error


async def test_the_openai_sdk_raises_its_own_exceptions_with_type_and_code(stack: Stack) -> None:
    client = _sdk(stack)
    user: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="no-such-model", messages=user, max_tokens=2)
    assert (missing.value.status_code, missing.value.type, missing.value.code) == (
        404,
        "invalid_request_error",
        "model_not_found",
    )
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=user, max_tokens=0)
    assert (bad.value.type, bad.value.code, bad.value.param) == ("invalid_request_error", "invalid_field", "max_tokens")
    # The engine's own 400 (vLLM's type "BadRequestError", code 400) comes back in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as engine:
        await client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    assert (engine.value.type, engine.value.code) == ("invalid_request_error", None)
    assert "out of vocabulary" in engine.value.message
    with pytest.raises(openai.AuthenticationError) as unknown_key:
        await _sdk(stack, "not-a-key").chat.completions.create(model=MODEL, messages=user, max_tokens=2)
    assert (unknown_key.value.type, unknown_key.value.code) == ("authentication_error", "unauthenticated")
    await client.close()


async def test_previous_response_not_found_is_the_sdk_not_found_error(stack: Stack) -> None:
    client = _sdk(stack)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert (missing.value.type, missing.value.code, missing.value.param) == (
        "invalid_request_error",
        "previous_response_not_found",
        "previous_response_id",
    )
    await client.close()


async def test_raw_http_errors_are_json_in_the_routes_shape(stack: Stack) -> None:
    c = stack.client
    r = await c.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and _openai_error(r)["type"] == "invalid_request_error"
    r = await c.get("/v1/no-such-route")
    assert r.status_code == 404
    assert _openai_error(r) == {
        "message": "Invalid URL (GET /v1/no-such-route)",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        r = await c.get(path)
        assert r.status_code == 405 and r.headers["allow"] == "POST", (path, r.headers)
        assert _openai_error(r)["code"] == "method_not_allowed"
    r = await c.put("/v1/models")
    assert r.status_code == 405 and _openai_error(r)["type"] == "invalid_request_error"
    # The Messages API keeps Anthropic's shape, for the router's answers too.
    r = await c.get("/v1/messages")
    assert r.status_code == 405 and r.headers["content-type"] == "application/json"
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Method GET is not allowed on /v1/messages"},
    }
    r = await c.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 2, "messages": []})
    assert r.status_code in (400, 404) and r.json()["type"] == "error", r.text
    r = await c.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert set(r.json()["error"]) == {"type", "message"} and r.json()["error"]["type"] == "invalid_request_error"
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as anon:
        r = await anon.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert r.status_code == 401 and _openai_error(r)["type"] == "authentication_error"
        r = await anon.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": []})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


async def test_health_is_served_like_vllms(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as anon:  # no key, as a probe calls it
        r = await anon.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert (await anon.get("/healthz")).status_code == 200


async def test_a_broken_stream_ends_with_an_error_event_the_sdk_raises(stack: Stack) -> None:
    stack.gateway.core.settings.decode_timeout_s = 1.0
    stack.decode.cfg.stall_s, stack.decode.cfg.stall_after_tokens = 30.0, 2  # D stalls after 2 tokens
    async with stack.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
    ) as r:
        frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert json.loads(frames[-1]) == {
        "error": {
            "message": "upstream stream failed",
            "type": "server_error",
            "param": None,
            "code": "upstream_failed",
        }
    }
    client = _sdk(stack)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    )
    with pytest.raises(openai.APIError) as broken:
        async for _chunk in stream:
            pass
    assert (broken.value.type, broken.value.code) == ("server_error", "upstream_failed")
    await client.close()


async def test_cached_tokens_are_the_tokens_reused(stack: Stack) -> None:
    """The first turn (a miss: D got the whole prompt from P) reports 0 cached tokens, not the prompt; the next
    turn reports the verified prefix P pulled, non-streaming and streaming, on every route."""
    client = _sdk(stack)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=4, extra_body={"conversation_id": "cached-1"}
    )
    first = raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == "miss;tokens=0"
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens > 100 and first.usage.prompt_tokens_details.cached_tokens == 0
    await stack.settle()
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=4, extra_body={"conversation_id": "cached-1"}
    )
    second = raw.parse()
    verdict, tokens = raw.headers["x-kvbridge-reuse"].split(";tokens=")
    assert verdict == "hit" and int(tokens) > 0
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == int(tokens)
    await stack.settle()
    # Streaming: the usage chunk says the same.
    msgs += [{"role": "assistant", "content": second.choices[0].message.content}, {"role": "user", "content": "go"}]
    stream = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=msgs,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"conversation_id": "cached-1"},
    )
    verdict, tokens = stream.headers["x-kvbridge-reuse"].split(";tokens=")
    usage = [chunk.usage async for chunk in stream.parse() if chunk.usage is not None]
    assert verdict == "hit" and len(usage) == 1 and usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cached_tokens == int(tokens) > 0
    # The Responses and Messages APIs report the same count in their own fields (these turns start like the
    # chat's first: found by content, a keyless thread's hit).
    raw_response = await client.responses.with_raw_response.create(
        model=MODEL, input=LONG + " responses", max_output_tokens=4
    )
    response = raw_response.parse()
    reused = int(raw_response.headers["x-kvbridge-reuse"].split(";tokens=")[1])
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == reused
    await stack.settle()
    r = await stack.client.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONG + " messages"}]},
    )
    reused = int(r.headers["x-kvbridge-reuse"].split(";tokens=")[1])
    assert r.status_code == 200 and r.json()["usage"]["cache_read_input_tokens"] == reused, r.text
    await client.close()


async def test_the_anthropic_sdk_raises_its_own_exceptions_on_the_messages_route(stack: Stack) -> None:
    client = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, api_key="key-acme", max_retries=0)
    user: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="no-such-model", max_tokens=2, messages=user)
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=MODEL, max_tokens=0, messages=user)
    assert isinstance(bad.value.body, dict) and bad.value.body["error"]["type"] == "invalid_request_error"
    stranger = anthropic.AsyncAnthropic(base_url=stack.gateway.http_url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await stranger.messages.create(model=MODEL, max_tokens=2, messages=user)
    await client.close()
    await stranger.close()
