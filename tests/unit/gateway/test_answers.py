"""answers.py: the cached-token count and OpenAI's error shape written into D's answers (issue 31)."""

from __future__ import annotations

import json
from typing import Any

from kvbridge_services.gateway.answers import (
    SseRewriter,
    error_frame,
    openai_code,
    openai_type,
    reused_tokens,
    set_cached_tokens,
    translated_error,
)


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _payloads(data: bytes) -> list[Any]:
    return [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]


def test_types_and_codes() -> None:
    assert [openai_type(s) for s in (400, 401, 403, 404, 408, 413, 429, 500, 502, 503, 504)] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "invalid_request_error",
        "invalid_request_error",
        "invalid_request_error",
        "rate_limit_error",
        "server_error",
        "server_error",
        "server_error",
        "server_error",
    ]
    assert openai_code("MODEL_NOT_FOUND") == "model_not_found" and openai_code("") is None


def test_reused_tokens_are_ps_count_else_the_pulled_tokens_and_none_without_p() -> None:
    assert reused_tokens({"do_remote_prefill": True, "remote_prefill_cached_tokens": 48}, 32) == 48
    assert reused_tokens({"do_remote_prefill": True}, 32) == 32
    assert reused_tokens({"do_remote_prefill": True, "remote_prefill_cached_tokens": True}, 0) == 0
    assert reused_tokens({"do_remote_decode": False, "do_remote_prefill": False}, 0) is None  # D served it alone


def test_set_cached_tokens_keeps_other_details_and_never_exceeds_the_prompt() -> None:
    body: dict[str, Any] = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 99, "x": 1}}}
    set_cached_tokens(body, 0)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "x": 1}
    set_cached_tokens(body, 500)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    bare: dict[str, Any] = {"usage": {"prompt_tokens": 10}}  # vLLM without --enable-prompt-tokens-details
    set_cached_tokens(bare, 0)
    assert bare["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    untouched: dict[str, Any] = {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 7}}}
    set_cached_tokens(untouched, None)
    assert untouched["usage"]["prompt_tokens_details"]["cached_tokens"] == 7


def test_vllms_error_is_translated() -> None:
    vllm = {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
    assert translated_error(vllm) == {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    assert translated_error({"message": "x", "type": "InternalError", "code": 500})["type"] == "server_error"
    assert translated_error("boom") == {"message": "boom", "type": "server_error", "param": None, "code": None}
    assert json.loads(error_frame("gone", "upstream_failed")[6:]) == {
        "error": {"message": "gone", "type": "server_error", "param": None, "code": "upstream_failed"}
    }


def test_the_stream_rewriter_passes_token_frames_as_they_are_and_fixes_usage_and_errors() -> None:
    token = _frame({"choices": [{"delta": {"content": "error"}}]})  # "error" as content: not an error frame
    usage = _frame({"choices": [], "usage": {"prompt_tokens": 80, "prompt_tokens_details": {"cached_tokens": 80}}})
    failed = _frame({"error": {"message": "m", "type": "BadRequestError", "code": 400}})
    r = SseRewriter(16)
    plain = _frame({"choices": [{"delta": {"content": "hi"}}]})
    assert r.feed(plain) is plain  # the common case: not parsed, not copied
    assert _payloads(r.feed(token)) == _payloads(token)
    # A usage frame cut anywhere, even inside "prompt_tokens", comes out whole and corrected.
    data = usage + b"data: [DONE]\n\n"
    out = b""
    for cut in range(0, len(data), 7):
        out += r.feed(data[cut : cut + 7])
    out += r.flush()
    assert out.endswith(b"data: [DONE]\n\n")
    assert _payloads(out)[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert _payloads(r.feed(failed)) == [
        {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    ]
    # A partial frame at the end is handed on as it is.
    assert r.feed(b"data: {") == b"" and r.flush() == b"data: {"
