"""A conversation handle: its key, its history, and its KV kept alive between turns."""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import TYPE_CHECKING, Self

from kvbridge.gateway.v1 import gateway_pb2 as pb

from .channel import ClientOptions
from .completion import collected
from .lease import Heartbeater, LeaseClient

if TYPE_CHECKING:
    from .gateway import GatewayClient, Sampling

# The tenant a gateway without API keys (development mode) files every conversation under.
DEV_TENANT = "default"


def new_conversation_key() -> str:
    """An unguessable conversation key (192 random bits)."""
    return "conv-" + secrets.token_urlsafe(24)


class ConversationLeases:
    """The one :class:`Heartbeater` (one KeepAlive stream) that renews the leases of all open
    conversations of a gateway client. It runs while at least one conversation is open.

    Renewals go to the lease manager with the gateway client's credentials, so they resolve the
    tenant exactly as the gateway did: from a tenant API key (the ref's tenant left empty), from
    ``ClientOptions.tenant`` for a service key, or the gateway's development-mode tenant without a key.
    """

    def __init__(self, lease_target: str, options: ClientOptions, interval_s: float) -> None:
        self._target = lease_target
        self._options = options
        self._interval_s = interval_s
        self._client: LeaseClient | None = None
        self.heartbeater: Heartbeater | None = None
        self._open: set[tuple[str, str]] = set()

    @property
    def tenant(self) -> str:
        if self._options.tenant:
            return self._options.tenant
        return "" if self._options.api_key else DEV_TENANT

    @property
    def open_conversations(self) -> int:
        return len(self._open)

    def add(self, model: str, key: str) -> None:
        if self.heartbeater is None:
            self._client = LeaseClient(self._target, self._options)
            self.heartbeater = Heartbeater(self._client, interval_s=self._interval_s)
        self._open.add((model, key))
        self.heartbeater.add_conversation(self.tenant, model, key)
        self.heartbeater.start()

    async def remove(self, model: str, key: str) -> None:
        self._open.discard((model, key))
        if self.heartbeater is None:
            return
        self.heartbeater.remove_conversation(self.tenant, model, key)
        if not self._open:
            await self.heartbeater.stop()  # no idle stream while no conversation is open

    async def close(self) -> None:
        self._open.clear()
        if self.heartbeater is not None:
            await self.heartbeater.stop()
        if self._client is not None:
            await self._client.close()
        self._client = self.heartbeater = None


class Conversation:
    """One conversation: a key (kept for every turn), the message history, and, while open, its
    decode-held KV kept alive by the client's shared heartbeater. ``close()`` (or leaving
    ``async with``) releases that KV at once instead of waiting for the lease to expire.

    Create it with :meth:`GatewayClient.conversation`; to resume a conversation, pass its key and
    its history so far (the gateway reuses KV only for a prompt that extends the previous one).
    """

    def __init__(
        self,
        gateway: GatewayClient,
        *,
        model: str,
        key: str | None,
        system: str | None,
        history: Iterable[Mapping[str, str]],
        sampling: Sampling | None,
        cache_salt: str,
        leases: ConversationLeases | None,
    ) -> None:
        self._gateway = gateway
        self.model = model
        self.key = key or new_conversation_key()
        self.sampling = sampling
        self.cache_salt = cache_salt
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.messages += [dict(m) for m in history]
        self._leases = leases
        self._opened = False
        self.closed = False

    def open(self) -> None:
        """Starts keeping the conversation's lease alive (done by ``async with`` and the first turn)."""
        if self.closed:
            raise RuntimeError(f"conversation {self.key} is closed")
        if not self._opened and self._leases is not None:
            self._leases.add(self.model, self.key)
        self._opened = True

    def _turn(self, content: str, role: str, name: str, tool_call_id: str) -> list[dict[str, str]]:
        self.open()
        message = {"role": role, "content": content}
        if name:
            message["name"] = name
        if tool_call_id:
            message["tool_call_id"] = tool_call_id
        return [*self.messages, message]

    async def stream(
        self,
        content: str,
        *,
        role: str = "user",
        name: str = "",
        tool_call_id: str = "",
        sampling: Sampling | None = None,
    ) -> AsyncGenerator[pb.CreateChatCompletionResponse, None]:
        """Sends the history plus this message, and yields the reply chunk by chunk; once the whole reply
        arrived, both join the history (:meth:`send`: the same, the reply as one :class:`Completion`)."""
        messages = self._turn(content, role, name, tool_call_id)
        text = ""
        async for chunk in self._gateway.stream_chat(
            messages,
            model=self.model,
            conversation_id=self.key,
            sampling=sampling or self.sampling,
            cache_salt=self.cache_salt,
        ):
            text += chunk.delta_content
            yield chunk
        self.messages = [*messages, {"role": "assistant", "content": text}]

    send = collected(
        stream, "send", "Sends the history plus this message; on success both it and the reply join the history."
    )

    async def close(self) -> bool:
        """Stops the heartbeats and releases the decode-held KV; True if the gateway released any.
        Idempotent: a second call returns False."""
        if self.closed:
            return False
        self.closed = True
        if self._leases is not None and self._opened:
            await self._leases.remove(self.model, self.key)
        return await self._gateway.close_conversation(model=self.model, conversation_id=self.key)

    async def __aenter__(self) -> Self:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
