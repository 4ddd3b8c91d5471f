"""The gateway tokenizing in-process (``tokenizers`` setting) with the same HF tokenizer the engines use.

The engine simulators tokenize with the dev tokenizer and chat template (as vLLM would); compatibility-mode
registrations hash D's own prompt ids, so a later turn hits only if the gateway's local ids equal the engine's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbridge_services.devengines.model import build_tokenizer
from tests.fixtures.gateway_stack import Stack, reference, running_stack, turn

LONG = " ".join(f"w{i % 400}" for i in range(120))  # 120 tokens: above the 64-token reuse threshold


@pytest.fixture(scope="module")
def dev_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dev-tokenizer")
    build_tokenizer(path, 512)
    return path


@pytest.fixture
async def local_stack(dev_tokenizer: Path) -> AsyncIterator[Stack]:
    async with running_stack(sim_tokenizer=dev_tokenizer, gateway_tokenizer=dev_tokenizer) as s:
        yield s


def tokenized(stack: Stack, path: str) -> float:
    value = stack.gateway.core.metrics.registry.get_sample_value("kvbridge_gateway_tokenize_total", {"path": path})
    return value or 0.0


async def test_local_ids_match_the_engines_so_turns_reuse(local_stack: Stack) -> None:
    messages = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": LONG}]
    answer, verdict = await turn(local_stack, messages)
    assert verdict.startswith("miss")
    assert answer == await reference(local_stack, messages)
    # A new conversation (no entry in the gateway's copy of the registry): its turn went to P without being
    # tokenized, and its ids were computed while D decoded, for the next turn to resume.
    tokenizers = local_stack.gateway.core.tokenizers
    assert tokenizers is not None
    assert tokenized(local_stack, "local") == 0 and tokenizers.reused_tokens() == 0
    for _ in range(2):
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "w7 w8"}]
        answer, verdict = await turn(local_stack, messages)
        assert verdict.startswith("hit;"), verdict
        assert int(verdict.split("tokens=")[1]) >= 112  # the whole previous turn, floored to blocks
        assert answer == await reference(local_stack, messages)
    assert tokenized(local_stack, "local") == 2
    assert tokenized(local_stack, "engine") == 0
    assert tokenizers.reused_tokens() >= 2 * 112  # each later turn re-encoded only what followed the last one


async def test_a_keyless_conversation_is_encoded_incrementally_too(local_stack: Stack) -> None:
    """Without a conversation key the encoding is kept under the conversation's opening, up to its first user
    message (the thread's key comes after the ids): each later turn re-encodes only what follows the previous
    turn's prompt, the second turn too."""
    messages = [{"role": "user", "content": LONG}]
    answer, _ = await turn(local_stack, messages, conv=None)
    tokenizers = local_stack.gateway.core.tokenizers
    assert tokenizers is not None
    for _ in range(2):
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "w7 w8"}]
        answer, verdict = await turn(local_stack, messages, conv=None)
        assert verdict.startswith("hit;"), verdict
        assert answer == await reference(local_stack, messages)
    assert tokenized(local_stack, "local") == 3 and tokenized(local_stack, "engine") == 0
    assert tokenizers.reused_tokens() >= 2 * 112


async def test_requests_it_cannot_reproduce_use_the_engines_tokenize(local_stack: Stack) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": LONG}]
    answer, _ = await turn(local_stack, messages)  # a new conversation: not tokenized (nothing to look up)
    assert tokenized(local_stack, "engine") == 0
    messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "w7 w8"}]
    await turn(local_stack, messages, tools=tools)
    assert tokenized(local_stack, "engine") == 1
    assert tokenized(local_stack, "local") == 0
