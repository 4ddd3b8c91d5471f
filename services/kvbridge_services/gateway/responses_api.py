"""The OpenAI Responses API (``POST /v1/responses``) as a chat turn, and the chat answer as a Responses answer.

Pure translation, no I/O: :func:`to_chat` makes the chat body a turn runs with (``requests.parse_turn`` with kind
``chat``), :class:`ResponseBuilder` makes the response object from the chat answer, and :class:`ResponsesStream`
the Responses SSE events from the chat SSE chunks. Stored responses (``previous_response_id``) are
``responses_store.py``; the route is ``http_api.py``. Fields it does not translate (``reasoning``, ``include``,
``truncation``, ``service_tier``, any unknown one) are accepted and not used; ``conversation``,
``prompt`` and ``background: true`` are refused.

Append-only by construction: an input item becomes the same chat message every time it is sent (a
``function_call`` item is an assistant message's tool call with ``id = call_id`` and the ``arguments`` string
unchanged; a ``function_call_output`` a ``tool`` message with ``tool_call_id``; a one-part text content a plain
string), and a stored thread's messages are made by the same function from the answer's output items, so a
chain sent statefully (``previous_response_id``) or statelessly (the whole history as ``input``) renders the
same prompt, each turn an extension of the one before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import invalid_field

from .chatstream import ChatAnswer, ChatDelta, sse_event

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_UNSUPPORTED = {
    "conversation": "the conversations API is not served; chain turns with previous_response_id",
    "prompt": "prompt templates are not served",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid_field(f"{where}[{i}]", "must be an object")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid_field(f"{where}[{i}].text", "must be a string")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise invalid_field(f"{where}[{i}].image_url", "must be a URL (file_id is not served)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid_field(f"{where}[{i}].type", f"content part {kind!r} is not supported")
    return parts


def _content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string as is; text parts as one string when there is one, else chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(where, "must be a string or an array of content parts")
    parts = _text_parts(content, where)
    if len(parts) == 1 and parts[0]["type"] == "text":
        text: str = parts[0]["text"]
        return text
    return parts


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid_field(f"{where}.{name}", "must be a non-empty string")
    return value


def items_to_messages(items: Sequence[object], where: str = "input") -> list[dict[str, Any]]:
    """Responses input (or output) items → chat messages. A ``function_call`` joins the assistant message just
    before it (one assistant turn: its text and its calls), else starts one with no content."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid_field(at, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid_field(f"{at}.role", f"must be one of {sorted(_ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise invalid_field(f"{at}.arguments", "must be a string")
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {"name": _string(item, "name", at), "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", at),
                    "content": _content(output, f"{at}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # the engines' templates drop earlier turns' reasoning; so does the gateway
        else:
            raise invalid_field(f"{at}.type", f"input item type {kind!r} is not supported")
    return messages


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid_field("tools", "must be an array")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid_field(f"tools[{i}].type", "only function tools are supported")
        fn: dict[str, Any] = {"name": _string(tool, "name", f"tools[{i}]")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if tool.get("parameters") is not None:
            fn["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> object:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_field("tool_choice", "must be auto, none, required or {type: function, name}")


def _response_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_field("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema: dict[str, Any] = {"name": fmt.get("name") or "schema", "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_field("text.format.type", "must be text, json_object or json_schema")


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses request, translated: the chat body to run, and what the answer echoes and stores."""

    chat_body: dict[str, Any]
    new_messages: list[dict[str, Any]]  # this request's input items as chat messages (what a stored thread adds)
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool
    previous_response_id: str | None
    stream: bool


def to_chat(body: dict[str, Any], history: Sequence[dict[str, Any]] = ()) -> ResponsesRequest:
    """A Responses body → the chat body of its turn. ``history``: the stored thread of ``previous_response_id``
    (its chat messages, without instructions: those of an earlier response are not carried over)."""
    for name, why in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise invalid_field(name, why)
    if body.get("background"):
        raise invalid_field("background", "background responses are not served")
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        new = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        new = items_to_messages(raw_input)
    else:
        raise invalid_field("input", "must be a string or an array of input items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_field("instructions", "must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [*history, *new]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
            raise invalid_field("max_output_tokens", "must be a positive integer")
        chat["max_tokens"] = max_output
    for name in ("temperature", "top_p", "user", "seed", "top_k", "min_tokens", "stop"):
        if body.get(name) is not None:
            chat[name] = body[name]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_field("stream", "must be a boolean")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid_field("store", "must be a boolean")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise invalid_field("previous_response_id", "must be a non-empty string")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid_field("metadata", "must be an object")
    echo = {
        "model": body.get("model"),
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(chat, new, echo, store, previous, stream)


def conversation_key(body: dict[str, Any]) -> str | None:
    """A client's own key for a new chain: ``prompt_cache_key`` (OpenAI's cache hint), or the gateway's
    ``conversation_id`` / ``session_id`` (None: none given)."""
    for name in ("prompt_cache_key", "conversation_id", "session_id"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    return None


# -- the answer ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ResponseBuilder:
    """The response object of one request; item ids fixed up front so streamed events and the final object agree."""

    request: ResponsesRequest
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    reasoning_id: str = field(default_factory=lambda: new_id("rs"))
    call_ids: list[str] = field(default_factory=list)

    def call_item_id(self, index: int) -> str:
        while len(self.call_ids) <= index:
            self.call_ids.append(new_id("fc"))
        return self.call_ids[index]

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [] if status == "in_progress" else [_output_text(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def call_item(self, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": self.call_item_id(index),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def output(self, answer: ChatAnswer) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if answer.reasoning:
            items.append(self.reasoning_item(answer.reasoning))
        if answer.text or not answer.tool_calls:
            items.append(self.message_item(answer.text))
        for i, call in enumerate(answer.tool_calls):
            items.append(self.call_item(i, call.id, call.name, call.arguments, "completed"))
        return items

    def response(self, answer: ChatAnswer | None, status: str | None = None) -> dict[str, Any]:
        """The response object: in progress (no answer yet), or complete with the answer's output and usage."""
        incomplete = answer is not None and answer.finish_reason == "length"
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status or ("in_progress" if answer is None else "incomplete" if incomplete else "completed"),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            **self.request.echo,
            "previous_response_id": self.request.previous_response_id,
            "store": self.request.store,
            "output": [] if answer is None else self.output(answer),
            "usage": None if answer is None else usage(answer),
        }
        return obj

    def thread_messages(self, answer: ChatAnswer) -> list[dict[str, Any]]:
        """This turn's part of a stored thread: its input and its answer, as the next request would send them."""
        return [*self.request.new_messages, *items_to_messages(self.output(answer), "output")]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(answer: ChatAnswer) -> dict[str, Any]:
    return {
        "input_tokens": answer.prompt_tokens,
        "input_tokens_details": {"cached_tokens": answer.cached_tokens},
        "output_tokens": answer.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


class ResponsesStream:
    """Chat chunks in, Responses SSE events out (``event:`` + ``data:`` with ``type`` and ``sequence_number``)."""

    def __init__(self, builder: ResponseBuilder, on_completed: Callable[[dict[str, Any], ChatAnswer], None]) -> None:
        self.b = builder
        self.answer = ChatAnswer()
        self._seq = 0
        self._index = 0  # the next output_index
        self._message_index: int | None = None  # output index of the open message item
        self._reasoning_done = False
        self._open_call: int | None = None  # tool-call index of the open function_call item
        self._call_index: dict[int, int] = {}  # tool-call index -> output index
        self._on_completed = on_completed
        self.failed = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)

    def start(self) -> bytes:
        created = self.b.response(None)
        return self._event("response.created", response=created) + self._event("response.in_progress", response=created)

    def _flush_reasoning(self) -> bytes:
        if self._reasoning_done or not self.answer.reasoning:
            return b""
        self._reasoning_done = True
        item = self.b.reasoning_item(self.answer.reasoning)
        index, self._index = self._index, self._index + 1
        return self._event("response.output_item.added", output_index=index, item=item) + self._event(
            "response.output_item.done", output_index=index, item=item
        )

    def _open_message(self) -> bytes:
        if self._message_index is not None:
            return b""
        self._message_index, self._index = self._index, self._index + 1
        return self._event(
            "response.output_item.added",
            output_index=self._message_index,
            item=self.b.message_item("", "in_progress"),
        ) + self._event(
            "response.content_part.added",
            item_id=self.b.message_id,
            output_index=self._message_index,
            content_index=0,
            part=_output_text(""),
        )

    def _close_message(self) -> bytes:
        index = self._message_index
        if index is None or index < 0:
            return b""
        self._message_index = -1  # closed: text after a tool call is not expected, and not reopened
        text = self.answer.text
        mid = self.b.message_id
        return (
            self._event(
                "response.output_text.done", item_id=mid, output_index=index, content_index=0, text=text, logprobs=[]
            )
            + self._event(
                "response.content_part.done", item_id=mid, output_index=index, content_index=0, part=_output_text(text)
            )
            + self._event("response.output_item.done", output_index=index, item=self.b.message_item(text))
        )

    def _close_call(self) -> bytes:
        if self._open_call is None:
            return b""
        i, self._open_call = self._open_call, None
        call = self.answer.tool_calls[i]
        index = self._call_index[i]
        return self._event(
            "response.function_call_arguments.done",
            item_id=self.b.call_item_id(i),
            output_index=index,
            name=call.name,
            arguments=call.arguments,
        ) + self._event(
            "response.output_item.done",
            output_index=index,
            item=self.b.call_item(i, call.id, call.name, call.arguments, "completed"),
        )

    def feed(self, delta: ChatDelta) -> bytes:
        out = b""
        if delta.error is not None:
            return self.fail(str(delta.error.get("message") or "the engine failed"))
        self.answer.add(delta)
        if delta.text or delta.tool_calls or delta.finish_reason:
            out += self._flush_reasoning()
        if delta.text and self._message_index != -1:
            out += self._open_message()
            assert self._message_index is not None
            out += self._event(
                "response.output_text.delta",
                item_id=self.b.message_id,
                output_index=self._message_index,
                content_index=0,
                delta=delta.text,
                logprobs=[],
            )
        for i, _call_id, _name, arguments in delta.tool_calls:
            if i not in self._call_index:
                out += self._close_message() + self._close_call()
                self._call_index[i] = self._index
                self._index += 1
                self._open_call = i
                call = self.answer.tool_calls[i]
                out += self._event(
                    "response.output_item.added",
                    output_index=self._call_index[i],
                    item=self.b.call_item(i, call.id, call.name, "", "in_progress"),
                )
                arguments = call.arguments  # everything so far, the first fragment included
            if arguments and i == self._open_call:
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.b.call_item_id(i),
                    output_index=self._call_index[i],
                    delta=arguments,
                )
        return out

    def finish(self) -> bytes:
        """The stream ended ([DONE]): closes what is open and sends ``response.completed`` (or ``incomplete``)."""
        if self.failed:
            return b""
        out = self._flush_reasoning()
        if not self.answer.tool_calls and self._message_index is None:
            out += self._open_message()  # an empty answer still has its (empty) message
        out += self._close_message() + self._close_call()
        final = self.b.response(self.answer)
        self._on_completed(final, self.answer)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=final)

    def fail(self, message: str) -> bytes:
        if self.failed:
            return b""
        self.failed = True
        final = self.b.response(self.answer, status="failed")
        final["error"] = {"code": "server_error", "message": message}
        return self._event("error", code="server_error", message=message, param=None) + self._event(
            "response.failed", response=final
        )


__all__ = [
    "ResponseBuilder",
    "ResponsesRequest",
    "ResponsesStream",
    "conversation_key",
    "items_to_messages",
    "new_id",
    "to_chat",
    "usage",
]
