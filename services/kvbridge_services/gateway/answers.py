"""What the gateway corrects in D's answer before a client reads it, the same for every front door: the prompt
tokens reported as cached (``usage.prompt_tokens_details.cached_tokens``) and errors in OpenAI's shape, in a
non-streaming body and in D's SSE stream.

**Cached tokens.** vLLM's D counts every prompt token it received over NIXL from P as a cache hit, so on a plain
prefill (a miss) D would report the whole prompt as cached. vLLM 0.32 corrects this only when P's returned
``remote_prefill_cached_tokens`` reaches D (and only with ``--enable-prompt-tokens-details``); the engine
simulators do not. The gateway reports what no engine computed for this turn: P's own count
(``remote_prefill_cached_tokens``: P's local prefix-cache hits plus the tokens it pulled from D) when P states it,
else the verdict's pulled tokens; a turn served by the holder D alone (placement's ``prefill_on_holder``, no P,
nothing transferred) keeps D's own count, which is its prefix cache's.

**Errors.** OpenAI's ``{"error": {"message", "type", "param", "code"}}``: ``type`` from the HTTP status
(:func:`openai_type`), ``code`` the machine reason in lower case (:func:`openai_code`). An error frame in D's
stream (vLLM's ``{"error": {..., "type": "BadRequestError", "code": 400}}``) is translated the same way, and the
gateway's own frame for a broken stream has that shape too.
"""

from __future__ import annotations

import json
from typing import Any

# OpenAI's error types by HTTP status (its API answers a 404 for an unknown model as an invalid_request_error too).
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
OPENAI_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error", "server_error"}
)
# A frame longer than this without its end is passed on as it is (D's chunks are a few hundred bytes).
_MAX_HELD_BYTES = 1024 * 1024
_ENDS = (b"\n\n", b"\r\n\r\n")


def openai_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: ``invalid_request_error`` for the client's errors,
    ``authentication_error`` (401), ``permission_error`` (403), ``rate_limit_error`` (429), ``server_error``."""
    return _OPENAI_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")


def openai_code(reason: str | None) -> str | None:
    """The error ``code`` of the OpenAI-compatible routes: the machine reason in lower case, as OpenAI's codes are
    written (``MODEL_NOT_FOUND`` -> ``model_not_found``, ``TOO_LARGE`` -> ``too_large``)."""
    return reason.lower() if reason else None


def openai_error_fields(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code}


def error_frame(message: str, code: str, kind: str = "server_error") -> bytes:
    """One SSE ``data:`` event carrying an error in OpenAI's shape (what the OpenAI SDK raises as ``APIError``)."""
    payload = {"error": openai_error_fields(message, kind, code)}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def translated_error(err: Any) -> dict[str, Any]:
    """An engine's error object (vLLM's: ``type`` its exception class, ``code`` the HTTP status) in OpenAI's
    shape; one already in it is kept."""
    if not isinstance(err, dict):
        return openai_error_fields(str(err), "server_error")
    status = err.get("code")
    kind = err.get("type")
    if kind not in OPENAI_TYPES:
        kind = openai_type(status) if isinstance(status, int) and not isinstance(status, bool) else "server_error"
    code = err.get("code") if isinstance(err.get("code"), str) else None
    param = err.get("param") if isinstance(err.get("param"), str) else None
    return openai_error_fields(str(err.get("message") or "the engine failed"), kind, code, param)


def set_cached_tokens(body: dict[str, Any], cached: int | None) -> None:
    """Writes ``cached`` into a response's (or a stream chunk's) ``usage.prompt_tokens_details.cached_tokens``,
    at most its ``prompt_tokens``; None, or a body without usage, changes nothing."""
    usage = body.get("usage")
    if cached is None or not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        cached = max(0, min(cached, prompt))
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}


def reused_tokens(p_params: dict[str, Any], pulled_tokens: int) -> int | None:
    """The tokens this turn's answer reports as cached: P's count (``remote_prefill_cached_tokens``) when D's
    params came from P, else ``pulled_tokens``; None for a turn D served alone (D's own count stands)."""
    if not p_params.get("do_remote_prefill"):
        return None
    cached = p_params.get("remote_prefill_cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return pulled_tokens


def _needs_rewrite(data: bytes) -> bool:
    return b'"prompt_tokens"' in data or b'"error"' in data


def _rewrite_event(event: bytes, cached: int | None) -> bytes:
    lines = event.split(b"\n")
    data = [line for line in lines if line.startswith(b"data:")]
    if len(data) != 1 or not _needs_rewrite(data[0]):
        return event
    try:
        obj = json.loads(data[0][5:])
    except ValueError:
        return event
    if not isinstance(obj, dict):
        return event
    if "error" in obj:
        obj["error"] = translated_error(obj["error"])
    elif "usage" in obj:
        set_cached_tokens(obj, cached)
    else:
        return event
    new = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return b"\n".join(new if line is data[0] else line for line in lines)


class SseRewriter:
    """D's SSE bytes with their usage and error frames corrected. Bytes pass on as they arrive, except the part of a
    frame whose end has not arrived yet (held until it does: a client cannot use half a frame either); frames
    without usage or an error pass on unchanged, without being parsed."""

    def __init__(self, cached: int | None) -> None:
        self._cached = cached
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._held and chunk.endswith(_ENDS) and not _needs_rewrite(chunk):
            return chunk  # the common case: whole frames of tokens
        data = self._held + chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if cut == 0 and len(data) <= _MAX_HELD_BYTES:
            self._held = data
            return b""
        if cut == 0:  # not SSE as D sends it: passed on as it is
            self._held = b""
            return data
        whole, self._held = data[:cut], data[cut:]
        if not _needs_rewrite(whole) or b"\r" in whole:
            return whole
        events = whole[:-2].split(b"\n\n")
        return b"\n\n".join(_rewrite_event(e, self._cached) for e in events) + b"\n\n"

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


__all__ = [
    "OPENAI_TYPES",
    "SseRewriter",
    "error_frame",
    "openai_code",
    "openai_error_fields",
    "openai_type",
    "reused_tokens",
    "set_cached_tokens",
    "translated_error",
]
