"""The pure parts of one turn's steps (gateway/prompt_ids.py, prefill.py, decode.py, enginecalls.py,
turnstate.py): what P and D are sent, what comes back to the client, how an engine failure reaches it."""

from __future__ import annotations

import time

import pytest

from kvbridge.errors import DeadlineExceeded, Unavailable
from kvbridge_services.gateway.decode import drop_token_ids, sequence_of
from kvbridge_services.gateway.enginecalls import completion_path, upstream_failure
from kvbridge_services.gateway.prefill import prefill_body
from kvbridge_services.gateway.prompt_ids import tokenize_request
from kvbridge_services.gateway.requests import Limits, parse_turn
from kvbridge_services.gateway.reuse import ReuseVerdict
from kvbridge_services.gateway.turn import Turn
from kvbridge_services.gateway.turnstate import TurnPlan, TurnResult
from kvbridge_services.gateway.upstream import UpstreamError

LIMITS = Limits(max_messages=10, max_prompt_tokens=100)


def chat(**extra: object) -> Turn:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    return parse_turn("chat", body, tenant="t", session_header=None, limits=LIMITS)


def completion(prompt: object = "hello") -> Turn:
    return parse_turn("completion", {"model": "m", "prompt": prompt}, tenant="t", session_header=None, limits=LIMITS)


def test_tokenize_request_carries_every_field_that_changes_the_rendered_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = tokenize_request(chat(tools=tools, chat_template_kwargs={"enable_thinking": False}, temperature=0.3))
    assert req == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": tools,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert tokenize_request(completion()) == {"model": "m", "prompt": "hello", "add_special_tokens": True}


def test_prefill_body_asks_one_unstreamed_token_and_drops_what_p_must_not_see() -> None:
    turn = chat(stream=True, stream_options={"include_usage": True}, max_completion_tokens=50, min_tokens=3)
    params = {"do_remote_decode": True}
    body = prefill_body(turn, params)
    assert body["max_tokens"] == 1 and body["stream"] is False and body["kv_transfer_params"] is params
    assert not {"stream_options", "max_completion_tokens", "min_tokens", "session_id"} & body.keys()
    assert body["messages"] == turn.body["messages"]
    assert "kv_transfer_params" not in turn.body  # the client's body is not changed


def test_decode_response_sequence_is_prompt_then_output_and_refuses_bad_ids() -> None:
    data = {"prompt_token_ids": [5, 6, 2**32 - 1], "choices": [{"token_ids": [7, 8]}]}
    assert list(sequence_of(chat(), data) or []) == [5, 6, 2**32 - 1, 7, 8]
    for bad in ([5, -1], [5, 2**32], [5, 1.5], [5, "6"]):
        assert sequence_of(chat(), {"prompt_token_ids": bad, "choices": [{"token_ids": [7]}]}) is None
    assert sequence_of(chat(), {"prompt_token_ids": [5], "choices": [{"token_ids": [None]}]}) is None
    assert sequence_of(chat(), {"choices": []}) is None
    done = {"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3]}]}
    assert list(sequence_of(completion([1, 2]), done) or []) == [1, 2, 3]


def test_token_ids_the_client_did_not_ask_for_are_removed() -> None:
    data = {"prompt_token_ids": [1], "choices": [{"token_ids": [2], "text": "a"}, "odd"]}
    drop_token_ids(data)
    assert data == {"choices": [{"text": "a"}, "odd"]}


def test_paths_and_failures_reach_the_client_as_one_status_each() -> None:
    assert completion_path(chat()) == "/v1/chat/completions"
    assert completion_path(completion()) == "/v1/completions"
    timed_out = upstream_failure("decode", UpstreamError("slow", timed_out=True))
    assert isinstance(timed_out, DeadlineExceeded) and "decode timed out" in str(timed_out)
    broken = upstream_failure("prefill", UpstreamError("refused", transport=True))
    assert isinstance(broken, Unavailable) and "prefill failed" in str(broken)


def test_a_turns_epoch_is_wall_microseconds_and_above_the_one_looked_up() -> None:
    plan = TurnPlan()
    before = time.time_ns() // 1_000
    assert before <= plan.epoch <= time.time_ns() // 1_000
    plan.next_epoch = before + 10**12  # an entry registered by a replica whose clock runs ahead
    assert plan.epoch == before + 10**12


def test_post_turn_steps_run_once_in_order() -> None:
    ran: list[int] = []
    result = TurnResult(ReuseVerdict(), after=[lambda: ran.append(1), lambda: ran.append(2)])
    result.finish()
    result.finish()
    assert ran == [1, 2]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_tokenize_request_does_not_alias_the_turn(kind: str) -> None:
    turn = chat() if kind == "chat" else completion()
    req = tokenize_request(turn)
    req["model"] = "other"
    assert turn.body["model"] == "m"
