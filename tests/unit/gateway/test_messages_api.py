"""The Anthropic Messages API's pure translation (gateway/messages_api.py) and the chat SSE reader it uses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_services.gateway import messages_api as ma
from kvbridge_services.gateway.chatstream import ChatDelta, SseFrames, answer_of, delta_of

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich", "days": [1, 2]}}


def test_request_becomes_the_chat_body() -> None:
    chat = ma.to_chat(
        {
            "model": "m",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": {}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "temperature": 0.2,
            "top_k": 5,
            "metadata": {"user_id": "u"},
            "stream": True,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "tools": [
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stop": ["END"],
        "temperature": 0.2,
        "top_k": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_tool_use_and_tool_result_history() -> None:
    chat = ma.to_chat(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": "checking"}, TOOL_USE]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {**TOOL_USE, "id": "t2"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "is_error": True}]},
            ],
        }
    )
    args = '{"city": "Zürich", "days": [1, 2]}'  # json.dumps(input, ensure_ascii=False): vLLM's own rendering
    assert ma.tool_arguments(TOOL_USE["input"]) == args
    fn = {"name": "get_weather", "arguments": args}
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t2", "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [TOOL_USE]}]}, "messages[0].content[0].type"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "assistant", "content": [{**TOOL_USE, "id": ""}]}]},
            "messages[0].content[0].id",
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "system": 3}, "system"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
            "tools[0]",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
            "tool_choice.type",
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences"),
    ],
)
def test_bad_input_names_its_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ma.to_chat({"model": "m", **body})
    assert caught.value.metadata["field"] == field


def _chat(message: dict[str, Any], finish: str, stop: str | None = None) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
    }


def test_answer_becomes_the_message_object() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msg = ma.message_of(
        answer_of(_chat({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")),
        message_id="msg_1",
        model="m",
        stop_sequences=[],
    )
    assert msg == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 8,
        },
    }
    text = answer_of(_chat({"role": "assistant", "content": "done"}, "stop", "END"))
    msg = ma.message_of(text, message_id="msg_2", model="m", stop_sequences=["END"])
    assert msg["content"] == [{"type": "text", "text": "done"}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    length = answer_of(_chat({"role": "assistant", "content": "d"}, "length"))
    assert ma.message_of(length, message_id="m", model="m", stop_sequences=[])["stop_reason"] == "max_tokens"


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw.decode().strip().split("\n\n"):
        name, data = event.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_events_text_then_tool_use() -> None:
    s = ma.MessagesStream(message_id="msg_1", model="m", stop_sequences=[])
    raw = s.start()
    raw += s.feed(ChatDelta(text="Hi"))
    raw += s.feed(ChatDelta(tool_calls=[(0, "call_1", "f", '{"a":')]))
    raw += s.feed(ChatDelta(tool_calls=[(0, "", "", " 1}")]))
    raw += s.feed(ChatDelta(finish_reason="tool_calls", usage={"prompt_tokens": 5, "completion_tokens": 4}))
    raw += s.finish()
    events = _events(raw)
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[4][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "f", "input": {}},
    }
    assert [e[1]["delta"]["partial_json"] for e in events[5:7]] == ['{"a":', " 1}"]
    assert events[8][1]["delta"]["stop_reason"] == "tool_use" and events[8][1]["usage"]["output_tokens"] == 4


def test_stream_error_frame_is_an_error_event() -> None:
    s = ma.MessagesStream(message_id="msg_1", model="m", stop_sequences=[])
    events = _events(s.feed(ChatDelta(error={"message": "upstream stream failed"})) + s.finish())
    assert events == [("error", {"type": "error", "error": {"type": "api_error", "message": "upstream stream failed"}})]


def test_sse_frames_split_anywhere_and_chunk_deltas() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    raw = f"data: {json.dumps(chunk)}\r\n\r\ndata: [DONE]\n\n".encode()
    frames = SseFrames()
    got = [p for i in range(len(raw)) for p in frames.feed(raw[i : i + 1])]
    assert got == [json.dumps(chunk), "[DONE]"]
    assert delta_of(chunk).text == "a"
    assert delta_of({"error": "boom"}).error == {"message": "boom"}
    assert delta_of({"choices": "odd"}) == ChatDelta()
