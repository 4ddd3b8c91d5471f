"""Every client reuses (issue 27, invariant 8), on real vLLM CPU engines with the kvbridge connector, through the stock
SDKs, sending no kvbridge field: a keyless OpenAI chat client (streaming, conversations interleaved, two at once),
the Responses API (stateless and with previous_response_id), the Anthropic Messages API with a tool_use/tool_result
history, and a chat tool-calling history (the kvbridge engines run with vLLM's automatic tool choice, as a
deployment serving tool-calling agents does: tests/e2e/conftest.py). Each turn's answer is compared with the same
request through a gateway with reuse off (greedy): 0 wrong answers. Named after test_kvbridge_pd.py so that it runs
right after it on the same engine pair (no restart).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest

from kvbridge_services.gateway.app import GatewayApp
from tests.e2e.gateway_turns import registry_routed_gateway
from tests.fixtures.control_plane_procs import ControlPlaneProcs
from tests.fixtures.vllm_engines import PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "tiny"
MAX_TOKENS = 12
API_KEY = "unused"  # the gateways run in development mode: any key, tenant "default"
GREEDY: dict[str, Any] = {"temperature": 0}  # the Anthropic SDK has no temperature argument: sent as extra_body
WORDS = [f"w{i}" for i in range(300)]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Tally:
    """Per client kind: later turns (after each conversation's first), their hits, and wrong answers."""

    later: int = 0
    hits: int = 0
    wrong: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def turn(self, index: int, verdict: str, answer: str, baseline: str) -> None:
        self.verdicts.append(verdict)
        if index > 0:
            self.later += 1
            self.hits += verdict.startswith("hit;")
        if answer != baseline:
            self.wrong.append(f"turn {index}: {answer!r} != {baseline!r} ({verdict})")


async def _pair(procs: ControlPlaneProcs, body: Callable[[GatewayApp, GatewayApp], Awaitable[None]]) -> None:
    async with (
        registry_routed_gateway(procs, reuse=True) as gw,
        registry_routed_gateway(procs, reuse=False) as baseline,
    ):
        await body(gw, baseline)


def _openai(gw: GatewayApp) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key=API_KEY, timeout=600, max_retries=0)


async def _chat_stream(client: openai.AsyncOpenAI, messages: list[Any], **extra: Any) -> tuple[str, str]:
    """One streamed chat turn through the stock SDK: its answer and the x-kvbridge-reuse verdict."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, stream=True, temperature=0, max_tokens=MAX_TOKENS, seed=7, **extra
    )
    verdict = raw.headers.get("x-kvbridge-reuse", "")
    parts = [chunk.choices[0].delta.content or "" async for chunk in raw.parse() if chunk.choices]
    return "".join(parts), verdict


async def test_a_keyless_streaming_openai_client_reuses_across_interleaved_conversations(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    tally = Tally()

    async def body(gw: GatewayApp, baseline: GatewayApp) -> None:
        client, plain = _openai(gw), _openai(baseline)
        rng = random.Random(27)
        conversations = [
            [{"role": "system", "content": _text(rng, 40)}, {"role": "user", "content": _text(rng, 60)}]
            for _ in range(8)
        ]

        async def one_turn(c: int, index: int) -> None:
            msgs = conversations[c]
            answer, verdict = await _chat_stream(client, msgs)
            reference, _ = await _chat_stream(plain, msgs)
            tally.turn(index, verdict, answer, reference)
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": _text(rng, 15)}]

        for index in range(3):
            for pair in range(0, len(conversations), 2):  # two conversations at once, interleaved turn by turn
                await asyncio.gather(one_turn(pair, index), one_turn(pair + 1, index))

    await _pair(control_plane, body)
    assert tally.wrong == []
    assert tally.later == 16 and tally.hits >= 0.8 * tally.later, tally.verdicts


async def test_the_responses_api_reuses_stateless_and_with_previous_response_id(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    stateless, stateful = Tally(), Tally()

    async def body(gw: GatewayApp, baseline: GatewayApp) -> None:
        client, plain = _openai(gw), _openai(baseline)
        rng = random.Random(28)
        history: list[Any] = [{"role": "user", "content": _text(rng, 90)}]
        for index in range(3):  # stateless: the whole history as input items, no previous_response_id
            raw = await client.responses.with_raw_response.create(
                model=MODEL, input=history, instructions="be brief", temperature=0, max_output_tokens=MAX_TOKENS
            )
            answer = raw.parse().output_text
            reference = (
                await plain.responses.create(
                    model=MODEL, input=history, instructions="be brief", temperature=0, max_output_tokens=MAX_TOKENS
                )
            ).output_text
            stateless.turn(index, raw.headers.get("x-kvbridge-reuse", ""), answer, reference)
            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": _text(rng, 15)}]
        previous: str | None = None
        previous_plain: str | None = None
        first = _text(rng, 90)
        for index in range(3):  # stateful: each turn only the new input, chained by previous_response_id
            turn_input = first if index == 0 else _text(rng, 15)
            streamed = await client.responses.with_raw_response.create(
                model=MODEL,
                input=turn_input,
                previous_response_id=previous,
                temperature=0,
                max_output_tokens=MAX_TOKENS,
                stream=True,
            )
            text: list[str] = []
            async for event in streamed.parse():
                if event.type == "response.output_text.delta":
                    text.append(event.delta)
                elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                    previous = event.response.id
            ref = await plain.responses.create(
                model=MODEL,
                input=turn_input,
                previous_response_id=previous_plain,
                temperature=0,
                max_output_tokens=MAX_TOKENS,
            )
            previous_plain = ref.id
            stateful.turn(index, streamed.headers.get("x-kvbridge-reuse", ""), "".join(text), ref.output_text)

    await _pair(control_plane, body)
    for tally in (stateless, stateful):
        assert tally.wrong == []
        assert tally.hits == tally.later == 2, tally.verdicts


async def test_the_anthropic_sdk_reuses_a_tool_use_history(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    tally = Tally()

    async def body(gw: GatewayApp, baseline: GatewayApp) -> None:
        client = anthropic.AsyncAnthropic(base_url=gw.http_url, api_key=API_KEY, timeout=600, max_retries=0)
        plain = anthropic.AsyncAnthropic(base_url=baseline.http_url, api_key=API_KEY, timeout=600, max_retries=0)
        rng = random.Random(29)
        tools: list[Any] = [
            {
                "name": "lookup",
                "description": "looks a word up",
                "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
                "cache_control": {"type": "ephemeral"},
            }
        ]
        messages: list[Any] = [{"role": "user", "content": _text(rng, 90)}]
        for index in range(3):
            raw = await client.messages.with_raw_response.create(
                model=MODEL,
                system="be brief",
                messages=messages,
                tools=tools,
                max_tokens=MAX_TOKENS,
                extra_body=GREEDY,
            )
            answer = "".join(b.text for b in (await raw.parse()).content if b.type == "text")
            reference = await plain.messages.create(
                model=MODEL,
                system="be brief",
                messages=messages,
                tools=tools,
                max_tokens=MAX_TOKENS,
                extra_body=GREEDY,
            )
            tally.turn(
                index,
                raw.headers.get("x-kvbridge-reuse", ""),
                answer,
                "".join(b.text for b in reference.content if b.type == "text"),
            )
            call_id = f"toolu_{index}"
            messages += [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": answer},
                        {"type": "tool_use", "id": call_id, "name": "lookup", "input": {"word": f"w{index}"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call_id, "content": _text(rng, 15)}],
                },
            ]

    await _pair(control_plane, body)
    assert tally.wrong == []
    assert tally.hits == tally.later == 2, tally.verdicts


async def test_a_chat_tool_calling_history_reuses_without_a_key(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    tally = Tally()

    async def body(gw: GatewayApp, baseline: GatewayApp) -> None:
        client, plain = _openai(gw), _openai(baseline)
        rng = random.Random(30)
        tools: list[Any] = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
        msgs: list[Any] = [{"role": "user", "content": _text(rng, 90)}]
        for index in range(3):
            answer, verdict = await _chat_stream(client, msgs, tools=tools)
            reference, _ = await _chat_stream(plain, msgs, tools=tools)
            tally.turn(index, verdict, answer, reference)
            call = {"id": f"call_{index}", "type": "function", "function": {"name": "search", "arguments": '{"q": 1}'}}
            msgs += [
                {"role": "assistant", "content": answer, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{index}", "content": _text(rng, 15)},
            ]

    await _pair(control_plane, body)
    assert tally.wrong == []
    assert tally.hits == tally.later == 2, tally.verdicts
