"""The Responses API's pure translation (gateway/responses_api.py) and its stored responses (responses_store.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_services.gateway import responses_api as ra
from kvbridge_services.gateway.chatstream import ChatDelta, SseFrames, answer_of
from kvbridge_services.gateway.responses_store import ResponseStore

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":  "Paris"}'}


def test_input_string_instructions_and_sampling_become_the_chat_body() -> None:
    req = ra.to_chat(
        {
            "model": "m",
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": True,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
        }
    )
    assert req.chat_body == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert req.store and req.stream and req.new_messages == [{"role": "user", "content": "hi"}]


def test_function_call_items_are_tool_calls_with_their_arguments_unchanged() -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        CALL,
        {**CALL, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_3", "name": "g", "arguments": "{}"},
    ]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":  "Paris"}'}}
    assert ra.items_to_messages(items) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "let me see",
            "tool_calls": [{"id": "call_1", **call}, {"id": "call_2", **call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
        },
    ]


def test_several_text_parts_stay_parts() -> None:
    content = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert ra.items_to_messages([{"role": "user", "content": content}]) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": 3}, "input"),
        ({"input": [3]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{**CALL, "arguments": {"city": "Paris"}}]}, "input[0].arguments"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ],
)
def test_bad_input_names_its_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ra.to_chat({"model": "m", **body})
    assert caught.value.metadata["field"] == field


def _chat_result(text: str, calls: tuple[tuple[str, str, str], ...] = (), finish: str = "stop") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


def test_answer_with_text_and_calls_and_the_thread_it_stores() -> None:
    req = ra.to_chat({"model": "m", "input": "hi", "instructions": "sys"})
    b = ra.ResponseBuilder(req)
    answer = answer_of(_chat_result("ok", (("call_9", "f", '{"a": 1}'),), "tool_calls"))
    obj = b.response(answer)
    assert obj["status"] == "completed" and obj["object"] == "response" and obj["instructions"] == "sys"
    assert [i["type"] for i in obj["output"]] == ["message", "function_call"]
    assert obj["output"][0]["content"][0]["text"] == "ok"
    assert obj["output"][1] | {"id": "x"} == {
        "type": "function_call",
        "id": "x",
        "call_id": "call_9",
        "name": "f",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    assert obj["usage"]["input_tokens"] == 10 and obj["usage"]["total_tokens"] == 13
    # The stored thread is what a stateless client would send back: the same chat messages.
    assert b.thread_messages(answer) == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
    ]
    assert b.thread_messages(answer)[1:] == ra.items_to_messages(obj["output"])
    # And the next request from it renders the same history first (append-only), instructions first.
    nxt = ra.to_chat({"model": "m", "input": "more", "instructions": "sys"}, history=b.thread_messages(answer))
    assert nxt.chat_body["messages"][:3] == [{"role": "system", "content": "sys"}, *b.thread_messages(answer)]
    assert ra.ResponseBuilder(req).response(answer_of(_chat_result("x", finish="length")))["status"] == "incomplete"


def _events(raw: bytes) -> list[dict[str, Any]]:
    frames = SseFrames().feed(raw)
    return [json.loads(f) for f in frames]


def test_stream_events_text_then_a_call() -> None:
    req = ra.to_chat({"model": "m", "input": "hi", "stream": True})
    done: list[dict[str, Any]] = []
    s = ra.ResponsesStream(ra.ResponseBuilder(req), lambda obj, _answer: done.append(obj))
    raw = s.start()
    raw += s.feed(ChatDelta(text="Hel"))
    raw += s.feed(ChatDelta(text="lo"))
    raw += s.feed(ChatDelta(tool_calls=[(0, "call_1", "f", '{"a"')]))
    raw += s.feed(ChatDelta(tool_calls=[(0, "", "", ": 1}")]))
    raw += s.feed(ChatDelta(finish_reason="tool_calls"))
    raw += s.feed(ChatDelta(usage={"prompt_tokens": 4, "completion_tokens": 6}))
    raw += s.finish()
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Hello" and events[12]["arguments"] == '{"a": 1}'
    assert events[9]["output_index"] == 1 and events[9]["item"]["call_id"] == "call_1"
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] == 6 and [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert done == [final]
    assert raw.startswith(b"event: response.created\ndata: ")


def test_stream_error_frame_fails_the_response() -> None:
    s = ra.ResponsesStream(ra.ResponseBuilder(ra.to_chat({"model": "m", "input": "hi"})), lambda *_: None)
    s.start()
    events = _events(s.feed(ChatDelta(error={"message": "upstream stream failed"})) + s.finish())
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[1]["response"]["status"] == "failed"


def _response(rid: str, pad: int = 0) -> dict[str, Any]:
    return {"id": rid, "pad": "x" * pad}


def test_store_is_per_tenant_and_bounded_lru() -> None:
    evicted: list[int] = []
    store = ResponseStore(
        max_per_tenant=2, max_bytes_per_tenant=10_000, max_total_bytes=100_000, on_evict=lambda: evicted.append(1)
    )
    a = store.put(
        "acme", _response("r1"), thread_key="r1", parent=None, new_messages=[{"role": "user", "content": "a"}]
    )
    assert a is not None
    store.put("acme", _response("r2"), thread_key="r1", parent=a, new_messages=[{"role": "assistant", "content": "b"}])
    assert store.get("globex", "r1") is None  # another tenant's id is not found
    r2 = store.get("acme", "r2")
    assert r2 is not None and r2.thread_key == "r1" and [m["content"] for m in r2.messages] == ["a", "b"]
    assert store.get("acme", "r1") is not None  # r1 now the most recently used: r2 goes first
    store.put("acme", _response("r3"), thread_key="r3", parent=None, new_messages=[])
    assert store.get("acme", "r2") is None and store.get("acme", "r1") is not None and len(store) == 2
    assert store.evicted == 1 and evicted == [1]


def test_store_bytes_bounds_per_tenant_and_total() -> None:
    store = ResponseStore(max_per_tenant=100, max_bytes_per_tenant=3_000, max_total_bytes=5_000)
    for i in range(3):
        store.put("acme", _response(f"a{i}", 1_000), thread_key="k", parent=None, new_messages=[])
    assert store.get("acme", "a0") is None and store.get("acme", "a2") is not None  # 3 x ~1 KB > 3,000
    for i in range(3):
        store.put("globex", _response(f"g{i}", 1_000), thread_key="k", parent=None, new_messages=[])
    assert store.total_bytes <= 5_000
    assert store.get("globex", "g2") is not None
    assert store.put("acme", _response("big", 4_000), thread_key="k", parent=None, new_messages=[]) is None
    assert store.delete("globex", "g2") and not store.delete("globex", "g2")
