"""A turn's prompt token ids, from the cheapest source that has them: the client's own ids, the gateway's
local tokenizer (incremental per conversation), else P's /tokenize."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from typing import Any

from opentelemetry import trace

from kvbridge import telemetry as tel

from .enginecalls import EngineAccess, EngineStep
from .engines import EngineState
from .requests import CHAT_TEMPLATE_FIELDS, prompt_too_large
from .tokenizer import ATTR_TOKENIZE_PATH, LocalTokenizers
from .turn import Turn
from .upstream import UpstreamError


def encoding_slot(turn: Turn) -> Hashable | None:
    """Under what the tokenizer keeps this turn's encoding for the next turn to resume: the conversation, or for a
    keyless chat turn its opening, the messages up to its first user message (the same on every turn of the
    conversation; a keyless thread's key is known only once its ids are, and the ids come first). Keyless
    conversations that open alike share a slot and may re-encode whole; the tokenizer resumes only from a
    previous text that the new one starts with, so a shared slot costs time, never ids."""
    if turn.conversation_key:
        return turn.tenant, turn.conversation_key
    messages = turn.body.get("messages") if turn.kind == "chat" else None
    if not isinstance(messages, list) or not messages:
        return None
    first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0)
    opening = json.dumps(messages[: first_user + 1], sort_keys=True, separators=(",", ":"), default=str).encode()
    return turn.tenant, "~keyless", hashlib.blake2b(opening, digest_size=16).digest()


def tokenize_request(turn: Turn) -> dict[str, Any]:
    """The body of vLLM's /tokenize that renders the prompt P will see for this turn."""
    if turn.kind == "chat":
        req: dict[str, Any] = {"model": turn.model, "messages": turn.body["messages"]}
        req.update((k, turn.body[k]) for k in CHAT_TEMPLATE_FIELDS if k in turn.body)
        return req
    return {
        "model": turn.model,
        "prompt": turn.body["prompt"],
        "add_special_tokens": turn.body.get("add_special_tokens", True),
    }


class PromptIds(EngineStep):
    def __init__(self, access: EngineAccess, tokenizers: LocalTokenizers | None) -> None:
        super().__init__(access)
        self._tokenizers = tokenizers

    async def local(self, turn: Turn) -> Sequence[int] | None:
        """The prompt's token ids from the gateway's own tokenizer, kept as the conversation's latest encoding;
        None where it has none for the request (no call to P)."""
        if self._tokenizers is None:
            return None
        ids = await self._tokenizers.ids(turn.model, turn.kind, turn.body, encoding_slot(turn))
        return None if ids is None else self._bounded(turn, ids)

    def _bounded(self, turn: Turn, ids: Sequence[int]) -> Sequence[int]:
        """``ids``, if within max_prompt_tokens: a text prompt's tokens are known only now (the text's size was
        bounded before, requests.MAX_CHARS_PER_TOKEN); past it, TOO_LARGE (HTTP 413) before they are hashed."""
        if len(ids) > self._s.max_prompt_tokens:
            raise prompt_too_large(
                "messages" if turn.kind == "chat" else "prompt",
                f"{len(ids)} tokens, more than max_prompt_tokens ({self._s.max_prompt_tokens})",
            )
        return ids

    async def of(self, turn: Turn, engine: EngineState) -> Sequence[int]:
        """The prompt's token ids (``engine``: the prefill engine asked when no other source has them).
        Raises UpstreamError when the engine cannot tokenize, ClientError when it rejects the request."""
        if turn.prompt_token_ids is not None:
            self._metrics.tokenize.labels("request").inc()
            return turn.prompt_token_ids
        if self._tokenizers is not None:
            local = await self.local(turn)
            if local is not None:
                self._metrics.tokenize.labels("local").inc()
                trace.get_current_span().set_attribute(ATTR_TOKENIZE_PATH, "local")
                return local
        self._metrics.tokenize.labels("engine").inc()
        trace.get_current_span().set_attribute(ATTR_TOKENIZE_PATH, "engine")
        with self._calls.span("kvbridge.gateway.tokenize", engine) as span:
            async with self._pool.using(engine):
                data = await self._http.post_json(
                    f"{engine.url}/tokenize",
                    tokenize_request(turn),
                    timeout_s=self._s.tokenize_timeout_s,
                    headers=tel.trace_headers(),
                )
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise UpstreamError("tokenize answered without token ids")
            span.set_attribute("kvbridge.prompt_tokens", len(tokens))
        return self._bounded(turn, tokens)
