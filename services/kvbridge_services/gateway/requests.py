"""OpenAI request bodies → a validated :class:`Turn` (HTTP and gRPC front doors share the parsing)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvbridge import ids
from kvbridge.errors import InvalidArgument, Reason, invalid_field

from .jsoncodec import loads_strict
from .kvparams import engine_cache_salt, strip_client_params
from .turn import Turn, TurnKind

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
SESSION_HEADER = "x-session-id"
# OpenAI bodies nest a handful of levels (tool schemas a few more); deeper is hostile.
MAX_JSON_DEPTH = 64


# The body fields of a chat request that change what the chat template renders (and so the prompt's tokens):
# the gateway's tokenization takes them into account, so they do not stop reuse (reuse.TOKENIZED_FIELDS).
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_special_tokens",
)


# How many characters of text one prompt token may stand for, at most, in the bound checked before the gateway
# tokenizes a text prompt: real text averages 3-5 characters a token, and long runs (indentation, rules of dashes)
# seldom exceed 16 even in the tokens made for them. A text past max_prompt_tokens x 16 characters is refused
# (TOO_LARGE, HTTP 413) before it costs a tokenization and a hash; its exact count is checked once tokenized
# (prompt_ids.py, against max_prompt_tokens).
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True, slots=True)
class Limits:
    max_messages: int
    max_prompt_tokens: int
    # The key of every engine request's per-tenant cache_salt (kvparams.cache_salt_key of the deployment secret;
    # the service passes it, so that every replica salts alike). A fresh random key by default: never unsalted.
    cache_salt_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of prompt text (message contents and text parts, or a text prompt)."""
        return self.max_prompt_tokens * MAX_CHARS_PER_TOKEN


def prompt_too_large(field_name: str, detail: str) -> InvalidArgument:
    return InvalidArgument(Reason.TOO_LARGE, f"{field_name}: {detail}", metadata={"field": field_name})


def _text_chars(messages: list[Any]) -> int:
    """Characters of the messages' text: string contents and the ``text`` of content parts."""
    total = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = loads_strict(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(Reason.INVALID_FIELD, f"malformed JSON body: {exc}", metadata={"field": "body"}) from exc
    except RecursionError:
        body = None  # nested past the interpreter's limit: reported below like any too-deep body
        _raise_too_deep()
    if not isinstance(body, dict):
        raise invalid_field("body", "must be a JSON object")
    _check_depth(body)
    return body


def _raise_too_deep() -> None:
    raise invalid_field("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _check_depth(value: object) -> None:
    """Iteratively (no recursion to exhaust): later stages re-serialize the body recursively."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            _raise_too_deep()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def conversation_key_of(body: dict[str, Any], header: str | None) -> str:
    """Body ``conversation_id``, then vLLM's ``session_id``, then the X-Session-ID header."""
    for name in ("conversation_id", "session_id"):
        value = body.get(name)
        if value is not None:
            return ids.CONVERSATION_KEY.check(name, value)
    if header is not None:
        return ids.CONVERSATION_KEY.check(SESSION_HEADER, header)
    return ""


def _check_messages(messages: object, limits: Limits) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "must be a non-empty array")
    if len(messages) > limits.max_messages:
        raise InvalidArgument(
            Reason.TOO_LARGE, f"messages: at most {limits.max_messages} allowed", metadata={"field": "messages"}
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise invalid_field(f"messages[{i}]", "must be an object")
        if msg.get("role") not in _ROLES:
            raise invalid_field(f"messages[{i}].role", f"must be one of {sorted(_ROLES)}")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise invalid_field(f"messages[{i}].content", "must be a string or an array of parts")
    if _text_chars(messages) > limits.max_prompt_chars:
        raise prompt_too_large(
            "messages",
            f"more than {limits.max_prompt_chars} characters of text (max_prompt_tokens x {MAX_CHARS_PER_TOKEN})",
        )


def _check_sampling(body: dict[str, Any]) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise invalid_field(name, "must be a positive integer")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
        ):
            raise invalid_field(name, "must be a finite number")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise invalid_field("stream", "must be a boolean")
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid_field("n", "only n=1 is supported")


def _prompt_ids(prompt: object, limits: Limits) -> list[int] | None:
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise prompt_too_large(
                "prompt", f"more than {limits.max_prompt_chars} characters (max_prompt_tokens x {MAX_CHARS_PER_TOKEN})"
            )
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) > limits.max_prompt_tokens:
            raise prompt_too_large("prompt", f"more than max_prompt_tokens ({limits.max_prompt_tokens}) tokens")
        if any(t < 0 or t >= 2**32 for t in prompt):
            raise invalid_field("prompt", "token ids must be 0..2^32-1")
        return list(prompt)
    raise invalid_field("prompt", "must be a string or a non-empty array of token ids (one prompt per request)")


def parse_turn(
    kind: TurnKind, body: dict[str, Any], *, tenant: str, session_header: str | None, limits: Limits
) -> Turn:
    model = ids.MODEL.check("model", body.get("model"))
    if kind == "chat":
        _check_messages(body.get("messages"), limits)
        prompt_ids = None
    else:
        prompt_ids = _prompt_ids(body.get("prompt"), limits)
    _check_sampling(body)
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str) or len(salt) > 256:
        raise invalid_field("cache_salt", "must be a string of at most 256 characters")
    if "request_id" in body:  # vLLM embeds it in its own request id, which keys D's registration
        ids.REQUEST_ID.check("request_id", body["request_id"])
    key = conversation_key_of(body, session_header)
    # What the engines see and the block-hash chain is scoped by: the tenant's salt combined with the client's.
    engine_salt = engine_cache_salt(limits.cache_salt_key, tenant, salt)
    upstream = strip_client_params(body)
    upstream["cache_salt"] = engine_salt
    return Turn(
        kind=kind,
        tenant=tenant,
        model=model,
        body=upstream,
        conversation_key=key,
        cache_salt=engine_salt,
        stream=bool(body.get("stream", False)),
        prompt_token_ids=prompt_ids,
        client_wants_token_ids=bool(body.get("return_token_ids")),
    )
