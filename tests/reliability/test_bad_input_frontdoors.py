"""Property-based bad input over the Responses (``/v1/responses``) and Messages (``/v1/messages``) front doors.

Wrong JSON types on every field and item, hostile ids and headers: every answer is 2xx or a 4xx in the API's
own error shape (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}``), never a 5xx;
a stream ends with its API's last event; the gateway's in-flight count returns to zero.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from .conftest import ACME_KEY, GLOBEX_KEY, MODEL, SecureStack
from .test_bad_input_http import HTTP_FUZZ, json_values, raw_bodies

text_or_junk = st.one_of(st.text(max_size=40), json_values)
response_items = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "bogus", 3]),
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", None]),
            "content": st.one_of(
                text_or_junk,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file", 1])},
                        optional={"text": text_or_junk, "image_url": text_or_junk},
                    ),
                    max_size=3,
                ),
            ),
            "call_id": text_or_junk,
            "name": text_or_junk,
            "arguments": text_or_junk,
            "output": text_or_junk,
        },
    ),
    max_size=4,
)
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), json_values),
    "input": st.one_of(st.text(max_size=40), response_items, json_values),
    "instructions": text_or_junk,
    "tools": st.one_of(
        json_values,
        st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["function", "web_search", 0])},
                optional={"name": text_or_junk, "parameters": json_values},
            ),
            max_size=2,
        ),
    ),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]), json_values),
    "max_output_tokens": st.one_of(st.integers(-3, 12), json_values),
    "temperature": json_values,
    "stream": st.one_of(st.booleans(), json_values),
    "store": st.one_of(st.booleans(), json_values),
    "previous_response_id": st.one_of(st.sampled_from(["resp_x", "", "x" * 300]), json_values),
    "prompt_cache_key": text_or_junk,
    "text": json_values,
    "metadata": json_values,
    "conversation": json_values,
}
blocks = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "document", 2])},
        optional={
            "text": text_or_junk,
            "id": text_or_junk,
            "name": text_or_junk,
            "input": json_values,
            "tool_use_id": text_or_junk,
            "content": st.one_of(text_or_junk, st.lists(st.fixed_dictionaries({"type": st.just("text")}), max_size=2)),
            "source": json_values,
            "cache_control": json_values,
        },
    ),
    max_size=3,
)
MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), json_values),
    "max_tokens": st.one_of(st.integers(-3, 12), json_values),
    "system": st.one_of(text_or_junk, blocks),
    "messages": st.one_of(
        json_values,
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", 5]),
                    "content": st.one_of(text_or_junk, blocks),
                }
            ),
            max_size=4,
        ),
    ),
    "tools": st.one_of(
        json_values,
        st.lists(
            st.fixed_dictionaries(
                {}, optional={"name": text_or_junk, "input_schema": json_values, "type": text_or_junk}
            ),
            max_size=2,
        ),
    ),
    "tool_choice": json_values,
    "stop_sequences": json_values,
    "temperature": json_values,
    "stream": st.one_of(st.booleans(), json_values),
    "metadata": json_values,
}
PATHS = {"/v1/responses": RESPONSES_FIELDS, "/v1/messages": MESSAGES_FIELDS}


def _body(path: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.fixed_dictionaries({}, optional=PATHS[path]).map(lambda b: json.dumps(b).encode()), raw_bodies)


requests = st.sampled_from(sorted(PATHS)).flatmap(lambda p: st.tuples(st.just(p), _body(p)))


def assert_clean(path: str, resp: httpx.Response) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400 and resp.status_code != 499:
        body = resp.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        else:
            assert body["error"]["type"] and body["error"]["message"], body
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        last = resp.text.rstrip().rsplit("\n\n", 1)[-1]
        ends = ("event: message_stop", "event: error") if path == "/v1/messages" else ("event: response.",)
        assert last.startswith(ends), resp.text[-300:]
        if path == "/v1/responses":
            assert last.split("\n")[0] in (
                "event: response.completed",
                "event: response.incomplete",
                "event: response.failed",
            ), last


@HTTP_FUZZ
@given(request=requests, key=st.sampled_from([ACME_KEY, GLOBEX_KEY]), anthropic_key=st.booleans())
async def test_front_doors_reject_hostile_bodies(
    secure: SecureStack, request: tuple[str, bytes], key: str, anthropic_key: bool
) -> None:
    path, body = request
    headers = {"x-api-key": key} if anthropic_key and path == "/v1/messages" else {}
    async with secure.http(key) as client, client.stream("POST", path, content=body, headers=headers) as resp:
        await resp.aread()
    assert_clean(path, resp)
    await secure.settle()
    assert secure.gateway.core.inflight == 0
