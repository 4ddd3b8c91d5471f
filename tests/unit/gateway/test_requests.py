from __future__ import annotations

from typing import Any

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_services.gateway.kvparams import cache_salt_key, engine_cache_salt
from kvbridge_services.gateway.requests import (
    MAX_CHARS_PER_TOKEN,
    Limits,
    conversation_key_of,
    parse_json_body,
    parse_turn,
)
from kvbridge_services.gateway.turn import Turn, TurnKind

LIMITS = Limits(max_messages=3, max_prompt_tokens=100)


def turn(kind: TurnKind, body: dict[str, Any], header: str | None = None) -> Turn:
    return parse_turn(kind, body, tenant="acme", session_header=header, limits=LIMITS)


def test_chat_turn_strips_internal_fields_and_keeps_sampling() -> None:
    t = turn(
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "conversation_id": "c1",
            "kv_transfer_params": {"remote_host": "evil"},
            "stream": True,
        },
    )
    assert t.conversation_key == "c1" and t.stream and t.tenant == "acme"
    assert "kv_transfer_params" not in t.body and "conversation_id" not in t.body
    assert t.body["temperature"] == 0


def test_conversation_key_sources_in_order() -> None:
    assert conversation_key_of({"conversation_id": "a", "session_id": "b"}, "c") == "a"
    assert conversation_key_of({"session_id": "b"}, "c") == "b"
    assert conversation_key_of({}, "c") == "c"
    assert conversation_key_of({}, None) == ""
    with pytest.raises(InvalidArgument):
        conversation_key_of({"conversation_id": "\u00e9"}, None)


def test_completion_token_prompt() -> None:
    t = turn("completion", {"model": "m", "prompt": [1, 2, 3]})
    assert t.prompt_token_ids == [1, 2, 3]
    assert turn("completion", {"model": "m", "prompt": "text"}).prompt_token_ids is None


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user"}], "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user"}], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"role": "user"}], "n": 2}, "n"),
    ],
)
def test_bad_chat_bodies_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        turn("chat", body)
    assert err.value.metadata["field"] == field


def test_message_count_limit() -> None:
    with pytest.raises(InvalidArgument) as err:
        turn("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}] * 4})
    assert err.value.reason == "TOO_LARGE"


def test_malformed_json() -> None:
    with pytest.raises(InvalidArgument):
        parse_json_body(b"{nope")
    with pytest.raises(InvalidArgument):
        parse_json_body(b"[1]")


def test_engine_pools_from_env_accept_url_lists_and_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge_services.gateway.config import GatewaySettings

    monkeypatch.setenv("KVBRIDGE_GATEWAY_PREFILL_ENGINES", "http://p1:8000, http://p2:8000/")
    monkeypatch.setenv("KVBRIDGE_GATEWAY_DECODE_ENGINES", '[{"url": "http://d1:8000", "model": "m"}]')
    settings = GatewaySettings()
    assert [e.url for e in settings.prefill_engines] == ["http://p1:8000", "http://p2:8000"]
    assert settings.decode_engines[0].model == "m"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_sampling_number_is_an_invalid_field(value: float) -> None:
    # The gRPC front door builds the body from protobuf floats, which may be NaN: never forwarded (jsoncodec).
    with pytest.raises(InvalidArgument) as err:
        turn("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": value})
    assert err.value.metadata == {"field": "temperature"}


def test_engine_cache_salt_is_per_tenant_and_client_salt_and_keyed() -> None:
    key = cache_salt_key(b"k" * 32)
    limits = Limits(max_messages=3, max_prompt_tokens=100, cache_salt_key=key)
    msgs = [{"role": "user", "content": "hi"}]

    def salt(tenant: str, client_salt: str | None) -> str:
        body: dict[str, Any] = {"model": "m", "messages": msgs}
        if client_salt is not None:
            body["cache_salt"] = client_salt
        t = parse_turn("chat", body, tenant=tenant, session_header=None, limits=limits)
        assert t.body["cache_salt"] == t.cache_salt  # what the engines get is what the chain is scoped by
        return t.cache_salt

    assert salt("acme", None) == salt("acme", "") == engine_cache_salt(key, "acme", "")  # stable per tenant
    seen = {salt("acme", None), salt("globex", None), salt("acme", "x"), salt("globex", "x"), salt("acmex", "")}
    assert len(seen) == 5
    assert engine_cache_salt(key, "a", "bc") != engine_cache_salt(key, "ab", "c")  # length-prefixed
    assert engine_cache_salt(cache_salt_key(b"j" * 32), "acme", "") != salt("acme", None)  # keyed by the secret
    assert all("acme" not in s and "globex" not in s for s in seen)


def test_text_prompts_are_bounded_in_characters_before_tokenizing() -> None:
    assert LIMITS.max_prompt_chars == 100 * MAX_CHARS_PER_TOKEN
    at_limit = "x" * LIMITS.max_prompt_chars
    assert turn("completion", {"model": "m", "prompt": at_limit}).prompt_token_ids is None
    turn("chat", {"model": "m", "messages": [{"role": "user", "content": at_limit}]})
    for kind, body, field in (
        ("completion", {"model": "m", "prompt": at_limit + "x"}, "prompt"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": at_limit + "x"}]}, "messages"),
        (
            "chat",
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": at_limit[:-5]},
                    {"role": "user", "content": [{"type": "text", "text": "123456"}]},
                ],
            },
            "messages",
        ),
    ):
        with pytest.raises(InvalidArgument) as err:
            turn(kind, body)  # type: ignore[arg-type]
        assert err.value.reason == "TOO_LARGE" and err.value.metadata["field"] == field


def test_a_client_request_id_must_be_a_request_id() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert turn("chat", {"model": "m", "messages": msgs, "request_id": "r-1"}).body["request_id"] == "r-1"
    for bad in ("x" * 129, "a b", "", 5):
        with pytest.raises(InvalidArgument) as err:
            turn("chat", {"model": "m", "messages": msgs, "request_id": bad})
        assert err.value.metadata["field"] == "request_id"
