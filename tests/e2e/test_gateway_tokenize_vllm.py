"""The gateway's local tokenizer gives exactly the ids of real vLLM's ``/tokenize`` (the tiny model's tokenizer).

Several chat bodies (system/user/assistant turns, without the generation prompt, continuing the final message,
text parts, names, template kwargs, special tokens) and completion prompts; a body vLLM rejects is one the
local tokenizer leaves to the engine. Engines come from the shared ``pd_engines`` fixture (stock vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge_services.gateway.tokenizer import LocalTokenizers
from tests.fixtures.vllm_engines import PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "tiny"
HISTORY = [
    {"role": "system", "content": "w1 w2 w3"},
    {"role": "user", "content": "w4 w5 hello, unknown words\n and  spaces"},
    {"role": "assistant", "content": "w6 w7"},
    {"role": "user", "content": "w8"},
]
CHAT_BODIES: list[dict[str, Any]] = [
    {"messages": HISTORY},
    {"messages": HISTORY, "add_generation_prompt": False},
    {
        "messages": [*HISTORY, {"role": "assistant", "content": "w9 w10"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": "w2"}]}]},
    {"messages": [{"role": "user", "content": "w3", "name": "alice"}]},
    {"messages": HISTORY, "add_special_tokens": True},
    {"messages": HISTORY, "chat_template_kwargs": {"unused_flag": True}},
]
PROMPTS: list[dict[str, Any]] = [
    {"prompt": "w1 w2 w3"},
    {"prompt": "w1 w2 w3", "add_special_tokens": False},
    {"prompt": "  w4\nunknown  w5 \t w6 "},
]


async def _engine_ids(c: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await c.post("/tokenize", json={"model": MODEL, **body})


async def test_local_ids_equal_vllm_tokenize(pd_engines: PDEngines, tiny_model_dir: Path) -> None:
    local = LocalTokenizers({MODEL: tiny_model_dir})
    try:
        async with httpx.AsyncClient(base_url=pd_engines.prefill.url, timeout=120) as c:
            for kind, bodies in (("chat", CHAT_BODIES), ("completion", PROMPTS)):
                for body in bodies:
                    r = await _engine_ids(c, body)
                    assert r.status_code == 200, (body, r.text)
                    ids = await local.ids(MODEL, kind, body)
                    assert ids is not None, body
                    assert list(ids) == r.json()["tokens"], body
            # Both flags on (continue_final_message with the generation prompt left at its default): vLLM
            # rejects it, and the local tokenizer leaves it to the engine (which then reports the error).
            rejected = {"messages": HISTORY, "continue_final_message": True}
            assert (await _engine_ids(c, rejected)).status_code == 400
            assert await local.ids(MODEL, "chat", rejected) is None
    finally:
        local.close()
