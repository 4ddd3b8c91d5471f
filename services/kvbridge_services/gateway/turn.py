"""The gateway's domain value for one turn: what a front door (chat, completions, Responses, Messages, gRPC)
parsed, independent of the wire format it came in. Every later stage reads it; none writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TurnKind = Literal["chat", "completion"]

ConversationId = tuple[str, str, str]  # tenant, model, conversation key


@dataclass(frozen=True, slots=True)
class Turn:
    kind: TurnKind
    tenant: str
    model: str
    # Upstream body: the client's own fields (sampling, stream, ...) minus anything internal.
    body: dict[str, Any]
    conversation_key: str = ""
    cache_salt: str = ""
    stream: bool = False
    # Exact prompt token ids when the client sent them (completions); else found by tokenizing.
    prompt_token_ids: list[int] | None = None
    client_wants_token_ids: bool = False
    timeout_s: float | None = None

    @property
    def conversation(self) -> ConversationId:
        """(tenant, model, conversation key): what the registry's entries, leases and post-turn work are keyed by."""
        return self.tenant, self.model, self.conversation_key
