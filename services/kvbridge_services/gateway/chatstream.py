"""The chat SSE stream a turn answers with, read back as chunks: what the Responses and Messages front doors
translate from (D's ``data: {...}`` frames, as the chat route forwards them, and ``data: [DONE]``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"
# A frame this long without an end is not a chat chunk D would send (its chunks are a few hundred bytes).
MAX_FRAME_BYTES = 4 * 1024 * 1024


class SseFrames:
    """Splits SSE bytes, in chunks cut anywhere, into the ``data`` payloads of complete events."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        if b"\r" in self._buf:  # CRLF line ends, possibly cut between the two bytes: the \r waits for its \n
            cut = self._buf.endswith(b"\r")
            self._buf = (self._buf[:-1] if cut else self._buf).replace(b"\r\n", b"\n") + (b"\r" if cut else b"")
        out: list[str] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                if len(self._buf) > MAX_FRAME_BYTES:
                    raise ValueError("an SSE event without an end")
                return out
            event, self._buf = self._buf[:end], self._buf[end + 2 :]
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode("utf-8", "replace"))


async def chat_chunks(stream: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a chat SSE stream, up to ``[DONE]`` (frames that are not JSON objects are skipped)."""
    frames = SseFrames()
    async for data in stream:
        for payload in frames.feed(data):
            if payload == DONE:
                return
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


@dataclass(slots=True)
class ToolCallAcc:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class ChatDelta:
    """What one chat chunk adds: text, tool-call fragments (index, id, name, arguments), the finish reason."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[int, str, str, str]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM: the stop string (or token id) that ended the answer
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


def delta_of(chunk: dict[str, Any]) -> ChatDelta:
    """One chat.completion.chunk, or an error frame, read defensively (a chunk with odd fields adds nothing)."""
    out = ChatDelta()
    err = chunk.get("error")
    if err is not None:
        out.error = err if isinstance(err, dict) else {"message": str(err)}
        return out
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        out.usage = usage
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return out
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        text = delta.get("content")
        if isinstance(text, str):
            out.text = text
        reasoning = delta.get("reasoning_content", delta.get("reasoning"))
        if isinstance(reasoning, str):
            out.reasoning = reasoning
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for n, call in enumerate(calls):
                if not isinstance(call, dict):
                    continue
                index = call.get("index", n)
                fn = call.get("function") if isinstance(call.get("function"), dict) else {}
                assert isinstance(fn, dict)
                out.tool_calls.append(
                    (
                        index if isinstance(index, int) else n,
                        str(call.get("id") or ""),
                        str(fn.get("name") or ""),
                        str(fn.get("arguments") or ""),
                    )
                )
    finish = choice.get("finish_reason")
    if isinstance(finish, str):
        out.finish_reason = finish
    stop = choice.get("stop_reason")
    if isinstance(stop, str):
        out.stop_reason = stop
    return out


@dataclass(slots=True)
class ChatAnswer:
    """A chat answer, from a non-streaming response or accumulated from a stream's chunks."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallAcc] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, delta: ChatDelta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        for index, call_id, name, arguments in delta.tool_calls:
            while len(self.tool_calls) <= index:
                self.tool_calls.append(ToolCallAcc())
            call = self.tool_calls[index]
            call.id = call.id or call_id
            call.name = call.name or name
            call.arguments += arguments
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.stop_reason is not None:
            self.stop_reason = delta.stop_reason
        if delta.usage is not None:
            self.set_usage(delta.usage)

    def set_usage(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens = _count(usage.get("prompt_tokens"))
        self.completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.cached_tokens = _count(details.get("cached_tokens"))


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def answer_of(body: dict[str, Any]) -> ChatAnswer:
    """The answer of a non-streaming chat.completion (missing fields read as empty)."""
    out = ChatAnswer()
    usage = body.get("usage")
    if isinstance(usage, dict):
        out.set_usage(usage)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return out
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    assert isinstance(message, dict)
    out.add(
        ChatDelta(
            text=message["content"] if isinstance(message.get("content"), str) else "",
            reasoning=str(message.get("reasoning_content") or message.get("reasoning") or ""),
            finish_reason=choice["finish_reason"] if isinstance(choice.get("finish_reason"), str) else None,
            stop_reason=choice["stop_reason"] if isinstance(choice.get("stop_reason"), str) else None,
        )
    )
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict):
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            assert isinstance(fn, dict)
            args = fn.get("arguments")
            out.tool_calls.append(
                ToolCallAcc(
                    id=str(call.get("id") or ""),
                    name=str(fn.get("name") or ""),
                    arguments=args if isinstance(args, str) else "",
                )
            )
    return out


def sse_event(name: str | None, payload: dict[str, Any]) -> bytes:
    """One SSE event: ``event: name`` (when named) and one ``data:`` line of compact JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {data}\n\n".encode()


__all__ = [
    "DONE",
    "ChatAnswer",
    "answer_of",
    "ChatDelta",
    "SseFrames",
    "ToolCallAcc",
    "chat_chunks",
    "delta_of",
    "sse_event",
]
