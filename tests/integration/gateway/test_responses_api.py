"""The OpenAI Responses API through the gateway with the stock OpenAI SDK: stateful chains (previous_response_id),
stateless histories with function-call items, streaming, stored responses, errors in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.gateway_stack import LONG, reference

from .conftest import BLOCK, MODEL, Stack

WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _client(stack: Stack, key: str = "key-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key=key, max_retries=0)


def _expected_hit(usage: Any) -> str:
    """The previous turn's prompt and answer, whole blocks: what the next turn of the chain reuses exactly."""
    return f"hit;tokens={(usage.input_tokens + usage.output_tokens) // BLOCK * BLOCK}"


async def test_stateful_chain_reuses_and_answers_equal(stack: Stack) -> None:
    client = _client(stack)
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=LONG, instructions="be brief", max_output_tokens=6
    )
    first = raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == "miss;tokens=0"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
    assert first.object == "response" and first.id.startswith("resp_")
    # The simulator answers until max_output_tokens: OpenAI's status for that is incomplete.
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text == await reference(stack, msgs, max_tokens=6)
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage is not None and first.usage.output_tokens == 6
    assert first.usage.total_tokens == first.usage.input_tokens + 6
    await stack.settle()

    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="again", instructions="be brief", previous_response_id=first.id, max_output_tokens=8
    )
    second = raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == _expected_hit(first.usage)
    msgs += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "again"}]
    assert second.output_text == await reference(stack, msgs)
    assert second.previous_response_id == first.id
    await stack.settle()

    # The third turn streams (a streamed turn is not registered in compatibility mode, but it reuses the second's).
    raw_stream = await client.responses.with_raw_response.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "and more"}]}],
        instructions="be brief",
        previous_response_id=second.id,
        max_output_tokens=8,
        stream=True,
    )
    assert raw_stream.headers["x-kvbridge-reuse"] == _expected_hit(second.usage)
    events = [event async for event in raw_stream.parse()]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    msgs += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "and more"}]
    expected = await reference(stack, msgs)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    completed = events[-1]
    assert completed.type == "response.incomplete"
    assert completed.response.output_text == expected
    assert completed.response.usage is not None and completed.response.usage.output_tokens == 8

    # Stored: retrievable by id (this tenant only), and the chain goes on from the streamed answer.
    got = await client.responses.retrieve(completed.response.id)
    assert got.output_text == expected and got.previous_response_id == second.id
    await client.close()


async def test_unknown_or_other_tenants_previous_response_is_404(stack: Stack) -> None:
    acme, globex = _client(stack), _client(stack, "key-globex")
    first = await acme.responses.create(model=MODEL, input="hello", max_output_tokens=2)
    for client, rid in ((acme, "resp_nope"), (globex, first.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model=MODEL, input="x", previous_response_id=rid, max_output_tokens=2)
        body = caught.value.body
        assert isinstance(body, dict)
        assert body == {
            "message": f"Previous response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    with pytest.raises(openai.NotFoundError):
        await globex.responses.retrieve(first.id)
    # store=false: answered, not kept.
    unstored = await acme.responses.create(model=MODEL, input="hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        await acme.responses.retrieve(unstored.id)
    await acme.close()
    await globex.close()


@pytest.mark.parametrize("session", [{"X-Session-ID": "fc-1"}, {}], ids=["keyed", "keyless"])
async def test_stateless_function_call_history_reuses(stack: Stack, session: dict[str, str]) -> None:
    """With a session key, and without any key (a keyless thread, ADR 0022): the same exact hit."""
    client = _client(stack)
    history: list[Any] = [
        {"role": "user", "content": LONG},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    raw = await client.responses.with_raw_response.create(
        model=MODEL,
        input=history,
        tools=[WEATHER_TOOL],
        max_output_tokens=6,
        store=False,
        extra_headers=session,
    )
    first = raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == "miss;tokens=0"
    chat_msgs: list[dict[str, Any]] = [
        {"role": "user", "content": LONG},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert first.output_text == await reference(stack, chat_msgs, max_tokens=6)
    await stack.settle()
    # The whole history again, with the answer's own output items and a new question: append-only, so it hits.
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"role": "user", "content": "thanks"})
    raw = await client.responses.with_raw_response.create(
        model=MODEL,
        input=history,
        tools=[WEATHER_TOOL],
        max_output_tokens=8,
        store=False,
        extra_headers=session,
    )
    second = raw.parse()
    assert raw.headers["x-kvbridge-reuse"] == _expected_hit(first.usage)
    chat_msgs += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "thanks"}]
    assert second.output_text == await reference(stack, chat_msgs)
    await client.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": [{"type": "mystery"}]}, "input[0].type"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x"}, "model"),
    ],
)
async def test_bad_input_is_400_in_openai_shape(stack: Stack, body: dict[str, Any], param: str) -> None:
    r = await stack.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


async def test_unauthenticated_is_401(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
