"""The Anthropic Messages API (``POST /v1/messages``) as a chat turn, and the chat answer as a Messages answer.

Pure translation, no I/O: :func:`to_chat` makes the chat body a turn runs with (``requests.parse_turn`` with kind
``chat``), :func:`message_of` the message object from a chat answer, :class:`MessagesStream` Anthropic's SSE
events from the chat SSE chunks. The route is ``http_api.py``.

Append-only by construction: a block becomes the same chat message every time it is sent. ``tool_use`` is an
assistant tool call whose ``arguments`` are ``json.dumps(input, ensure_ascii=False)`` with the default
separators (``", "`` and ``": "``) and the client's key order: the string vLLM's tool parsers make from a
parsed call, and the same string on every turn. ``tool_result`` is a ``tool`` message (``tool_call_id`` =
``tool_use_id``); one text block is a plain string. ``cache_control`` markers are accepted and ignored: reuse
is the gateway's job; so are ``metadata`` (the client's own bookkeeping), ``thinking`` (the answers carry no
thinking blocks) and any field it does not translate.
"""

from __future__ import annotations

import json
from typing import Any

from kvbridge.errors import invalid_field

from .chatstream import ChatAnswer, ChatDelta, sse_event
from .responses_api import new_id

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def tool_arguments(value: object) -> str:
    """A ``tool_use`` block's input as the chat tool call's ``arguments`` string (see the module's docstring)."""
    return json.dumps(value, ensure_ascii=False)


def _text_of(blocks: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    return str(blocks[0]["text"]) if len(blocks) == 1 and blocks[0]["type"] == "text" else blocks


def _blocks(content: object, where: str, *, allow_tools: bool) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid_field(where, "must be a string or an array of content blocks")
    out: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(block, dict):
            raise invalid_field(at, "must be an object")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid_field(f"{at}.text", "must be a string")
            out.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            out.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind in ("tool_use", "tool_result") and allow_tools:
            out.append({**block, "_at": at})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thinking: not part of the prompt (as the engines' templates drop it)
        else:
            raise invalid_field(f"{at}.type", f"content block {kind!r} is not supported here")
    return out


def _image_url(source: object, at: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise invalid_field(f"{at}.source", "must be a base64 or url image source")


def _string(block: dict[str, Any], name: str) -> str:
    value = block.get(name)
    if not isinstance(value, str) or not value:
        raise invalid_field(f"{block['_at']}.{name}", "must be a non-empty string")
    return value


def _messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid_field(at, "must be an object")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise invalid_field(f"{at}.role", "must be user or assistant")
        blocks = _blocks(msg.get("content"), f"{at}.content", allow_tools=True)
        if role == "assistant":
            content = [b for b in blocks if b["type"] != "tool_use"]
            calls = [
                {
                    "id": _string(b, "id"),
                    "type": "function",
                    "function": {"name": _string(b, "name"), "arguments": tool_arguments(b.get("input", {}))},
                }
                for b in blocks
                if b["type"] == "tool_use"
            ]
            if any(b["type"] == "tool_result" for b in blocks):
                raise invalid_field(f"{at}.content", "tool_result blocks belong in user messages")
            message: dict[str, Any] = {"role": "assistant", "content": _text_of(content) if content else None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            continue
        # A user message: its tool results first (one tool message each, in order), then its other content.
        rest: list[dict[str, Any]] = []
        for b in blocks:
            if b["type"] == "tool_use":
                raise invalid_field(f"{b['_at']}.type", "tool_use blocks belong in assistant messages")
            if b["type"] == "tool_result":
                result = b.get("content", "")
                parts = _blocks(result, f"{b['_at']}.content", allow_tools=False) if result != "" else []
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": _string(b, "tool_use_id"),
                        "content": _text_of(parts) if parts else "",
                    }
                )
            else:
                rest.append(b)
        if rest or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": _text_of(rest) if rest else ""})
    return out


def _system(system: object) -> dict[str, Any] | None:
    if system is None or system == "":
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system}
    if isinstance(system, list):
        blocks = _blocks(system, "system", allow_tools=False)
        if any(b["type"] != "text" for b in blocks):
            raise invalid_field("system", "must be text blocks")
        return {"role": "system", "content": _text_of(blocks)} if blocks else None
    raise invalid_field("system", "must be a string or an array of text blocks")


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid_field("tools", "must be an array")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise invalid_field(f"tools[{i}]", "only client tools (name, description, input_schema) are supported")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_field(f"tools[{i}].name", "must be a non-empty string")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object, chat: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise invalid_field("tool_choice", "must be an object")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid_field("tool_choice.type", "must be auto, any, none or tool (with a name)")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages body → the chat body of its turn."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid_field("max_tokens", "is required: a positive integer")
    system = _system(body.get("system"))
    messages = ([system] if system else []) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid_field("stop_sequences", "must be an array of strings")
        if stop:
            chat["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_field("stream", "must be a boolean")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# -- the answer ------------------------------------------------------------------------------------------
def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {}  # the model's arguments were not JSON: Anthropic's input is an object


def _stop(answer: ChatAnswer, stop_sequences: list[str]) -> tuple[str, str | None]:
    if answer.tool_calls:
        return "tool_use", None
    if answer.finish_reason == "stop" and answer.stop_reason in stop_sequences:
        return "stop_sequence", answer.stop_reason
    return _STOP_REASONS.get(answer.finish_reason or "stop", "end_turn"), None


def usage(answer: ChatAnswer) -> dict[str, Any]:
    return {
        "input_tokens": answer.prompt_tokens,
        "output_tokens": answer.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": answer.cached_tokens,
    }


def message_of(answer: ChatAnswer, *, message_id: str, model: str, stop_sequences: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if answer.text or not answer.tool_calls:
        content.append({"type": "text", "text": answer.text})
    for call in answer.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id or new_id("toolu"),
                "name": call.name,
                "input": _tool_input(call.arguments),
            }
        )
    stop_reason, stop_sequence = _stop(answer, stop_sequences)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(answer),
    }


def stop_sequences_of(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop_sequences")
    return [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []


class MessagesStream:
    """Chat chunks in, Anthropic SSE events out: message_start, content_block_start/delta/stop per block,
    message_delta (stop reason, usage), message_stop; an engine failure mid-stream is an ``error`` event."""

    def __init__(self, *, message_id: str, model: str, stop_sequences: list[str]) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences
        self.answer = ChatAnswer()
        self._block = -1  # index of the open content block (-1: none)
        self._text_open = False
        self._calls: dict[int, int] = {}  # tool-call index -> block index
        self._open_call: int | None = None
        self.failed = False

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self._block < 0 or not (self._text_open or self._open_call is not None):
            return b""
        self._text_open = False
        self._open_call = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._block += 1
        return out + sse_event(
            "content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block}
        )

    def feed(self, delta: ChatDelta) -> bytes:
        if delta.error is not None:
            return self.fail(str(delta.error.get("message") or "the engine failed"))
        self.answer.add(delta)
        out = b""
        if delta.text and not self._calls:
            if not self._text_open:
                out += self._open({"type": "text", "text": ""})
                self._text_open = True
            out += sse_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": self._block,
                    "delta": {"type": "text_delta", "text": delta.text},
                },
            )
        for i, _call_id, _name, arguments in delta.tool_calls:
            if i not in self._calls:
                call = self.answer.tool_calls[i]
                out += self._open(
                    {"type": "tool_use", "id": call.id or new_id("toolu"), "name": call.name, "input": {}}
                )
                self._calls[i] = self._block
                self._open_call = i
                arguments = call.arguments
            if arguments and i == self._open_call:
                out += sse_event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self._calls[i],
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    },
                )
        return out

    def finish(self) -> bytes:
        if self.failed:
            return b""
        out = b""
        if self._block < 0:  # an empty answer still has its (empty) text block
            out += self._open({"type": "text", "text": ""})
            self._text_open = True
        out += self._close()
        stop_reason, stop_sequence = _stop(self.answer, self.stop_sequences)
        out += sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage(self.answer),
            },
        )
        return out + sse_event("message_stop", {"type": "message_stop"})

    def fail(self, message: str) -> bytes:
        if self.failed:
            return b""
        self.failed = True
        return sse_event("error", error_body("api_error", message))


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        408: "timeout_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        504: "timeout_error",
    }.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


__all__ = [
    "MessagesStream",
    "error_body",
    "error_type",
    "message_of",
    "stop_sequences_of",
    "to_chat",
    "tool_arguments",
    "usage",
]
