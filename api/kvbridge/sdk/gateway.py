"""Async client of kvbridge.gateway.v1.GatewayService: chat and text completions, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2

from kvbridge.gateway.v1 import gateway_pb2 as pb
from kvbridge.gateway.v1 import gateway_pb2_grpc as pb_grpc

from .channel import BaseClient, ClientOptions
from .completion import Completion as Completion  # re-exported: kvbridge.sdk.gateway.Completion
from .completion import collected
from .conversation import Conversation, ConversationLeases

# A chat message: the proto, or a mapping like OpenAI's {"role": "user", "content": "..."}.
Message = pb.ChatMessage | Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters (as in the OpenAI API); None / empty leaves the engine's default."""

    max_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def to_proto(self) -> pb.SamplingParams:
        sp = pb.SamplingParams(max_tokens=self.max_tokens, stop=list(self.stop))
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(sp, name, value)
        return sp


def chat_message(message: Message) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    return pb.ChatMessage(
        role=message.get("role", ""),
        content=message.get("content", ""),
        name=message.get("name", ""),
        tool_call_id=message.get("tool_call_id", ""),
    )


def _as_dict(message: Message) -> dict[str, str]:
    if isinstance(message, Mapping):
        return dict(message)
    return {
        k: v
        for k, v in (
            ("role", message.role),
            ("content", message.content),
            ("name", message.name),
            ("tool_call_id", message.tool_call_id),
        )
        if v or k == "content"
    }


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class GatewayClient(BaseClient):
    """The gateway's gRPC API. Tenant comes from the API key (or ``ClientOptions.tenant`` for a service key).

    Generation RPCs stream; :meth:`chat` / :meth:`complete` collect the stream into a :class:`Completion`.
    Every call retries UNAVAILABLE with backoff, but a stream only until its first chunk arrived: after
    that the error is raised (a retry would start a second generation). Errors are the typed exceptions
    of :mod:`kvbridge.errors`.

    ``lease_target`` (the lease manager's address) lets :meth:`conversation` keep conversations' KV
    alive between turns; all open conversations of this client share one KeepAlive stream.
    """

    def __init__(
        self,
        target: str,
        options: ClientOptions | None = None,
        *,
        lease_target: str | None = None,
        heartbeat_interval_s: float = 5.0,
    ) -> None:
        super().__init__(target, options)
        self._leases = ConversationLeases(lease_target, self.options, heartbeat_interval_s) if lease_target else None

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._gateway = pb_grpc.GatewayServiceStub(channel)

    def _stub(self) -> Any:
        return self._gateway

    @property
    def conversation_leases(self) -> ConversationLeases | None:
        """The shared heartbeater of this client's conversations (None without ``lease_target``)."""
        return self._leases

    # -- chat ----------------------------------------------------------------------------------
    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        conversation_id: str = "",
        sampling: Sampling | None = None,
        cache_salt: str = "",
        engine_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[pb.CreateChatCompletionResponse, None]:
        """The answer's chunks as the decode engine produces them (the first carries ``reuse``, the last
        ``finish_reason`` and ``usage``). Retried on UNAVAILABLE only before the first chunk."""
        req = pb.CreateChatCompletionRequest(
            model=model,
            messages=[chat_message(m) for m in messages],
            conversation_id=conversation_id,
            sampling=(sampling or Sampling()).to_proto(),
            cache_salt=cache_salt,
        )
        if engine_timeout_s is not None:
            req.timeout.CopyFrom(_duration(engine_timeout_s))
        return self._server_stream("CreateChatCompletion", req, timeout_s=timeout_s)

    chat = collected(stream_chat, "chat", "The whole answer (see :meth:`stream_chat`).")

    # -- text completion -----------------------------------------------------------------------
    def stream_complete(
        self,
        prompt: str | Sequence[int],
        *,
        model: str,
        conversation_id: str = "",
        sampling: Sampling | None = None,
        cache_salt: str = "",
        engine_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[pb.CreateCompletionResponse, None]:
        """A text completion of ``prompt`` (text, or exact token ids), chunk by chunk."""
        req = pb.CreateCompletionRequest(
            model=model,
            conversation_id=conversation_id,
            sampling=(sampling or Sampling()).to_proto(),
            cache_salt=cache_salt,
        )
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        if engine_timeout_s is not None:
            req.timeout.CopyFrom(_duration(engine_timeout_s))
        return self._server_stream("CreateCompletion", req, timeout_s=timeout_s)

    complete = collected(stream_complete, "complete", "The whole completion (see :meth:`stream_complete`).")

    # -- the rest ------------------------------------------------------------------------------
    async def list_models(self) -> list[pb.Model]:
        resp: pb.ListModelsResponse = await self._unary("ListModels", pb.ListModelsRequest())
        return list(resp.models)

    async def close_conversation(self, *, model: str, conversation_id: str) -> bool:
        """Releases the conversation's decode-held KV now; False if there was nothing to release."""
        req = pb.CloseConversationRequest(model=model, conversation_id=conversation_id)
        resp: pb.CloseConversationResponse = await self._unary("CloseConversation", req)
        return resp.released

    def conversation(
        self,
        *,
        model: str,
        key: str | None = None,
        system: str | None = None,
        history: Iterable[Message] = (),
        sampling: Sampling | None = None,
        cache_salt: str = "",
    ) -> Conversation:
        """A :class:`Conversation` on this client (a new unguessable key unless ``key`` is given;
        ``history``: the messages of an existing conversation being resumed, after ``system``).

        Use it as ``async with``: while open, its lease is renewed (needs ``lease_target``); on exit
        the gateway releases its KV.
        """
        return Conversation(
            self,
            model=model,
            key=key,
            system=system,
            history=[_as_dict(m) for m in history],
            sampling=sampling,
            cache_salt=cache_salt,
            leases=self._leases,
        )

    async def close(self) -> None:
        if self._leases is not None:
            await self._leases.close()
        await super().close()
