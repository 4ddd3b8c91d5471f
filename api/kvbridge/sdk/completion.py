"""A whole answer collected from a streamed generation, and ``collected``: a streaming method's collecting twin."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvbridge.gateway.v1 import gateway_pb2 as pb

ReuseReport = pb.ReuseReport
Usage = pb.Usage
# One chunk of a streamed chat or text completion.
Chunk = pb.CreateChatCompletionResponse | pb.CreateCompletionResponse

P = ParamSpec("P")
S = TypeVar("S")


@dataclass(slots=True)
class Completion:
    """A whole answer: the concatenated chunks of one streamed call."""

    id: str = ""
    model: str = ""
    # Generated text (chat: the assistant message's content).
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    # How the turn used decode-held KV ("hit", "miss", "declined:<why>"), from the first chunk.
    reuse: ReuseReport = field(default_factory=ReuseReport)
    usage: Usage = field(default_factory=Usage)

    def add(self, chunk: Chunk) -> None:
        self.id = self.id or chunk.id
        self.model = self.model or chunk.model
        self.text += chunk.delta_content if isinstance(chunk, pb.CreateChatCompletionResponse) else chunk.delta_text
        self.token_ids.extend(chunk.delta_token_ids)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if chunk.HasField("reuse"):
            self.reuse = chunk.reuse
        if chunk.HasField("usage"):
            self.usage = chunk.usage


def collected(
    stream: Callable[Concatenate[S, P], AsyncIterator[Chunk]], name: str, doc: str
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, Completion]]:
    """The method ``name`` that takes the arguments of the streaming method ``stream`` and returns its chunks
    as one :class:`Completion` (its signature, as ``help`` shows it, is ``stream``'s returning a Completion)."""

    async def collect(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Completion:
        out = Completion()
        async for chunk in stream(self, *args, **kwargs):
            out.add(chunk)
        return out

    collect.__name__ = name
    collect.__qualname__ = stream.__qualname__.rpartition(".")[0] + "." + name
    collect.__doc__ = doc
    collect.__signature__ = inspect.signature(stream).replace(return_annotation="Completion")  # type: ignore[attr-defined]
    return collect


__all__ = ["Chunk", "Completion", "ReuseReport", "Usage", "collected"]
