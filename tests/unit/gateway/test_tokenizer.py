"""The gateway's local tokenizer on the dev tokenizer (kvbridge_services.devengines.model): the ids vLLM's
/tokenize defaults give, the requests it leaves to P's /tokenize (None), and configuration errors at start.

Dev vocabulary: <unk> 0, <s> 1, </s> 2, <pad> 3, user 4, assistant 5, system 6, ":" 7, w<N> N+8.
Dev chat template: "<role> : <content> \\n" per message, then "assistant : " with add_generation_prompt.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvbridge_services.devengines.model import build_tokenizer
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.gateway.tokenizer import LocalTokenizers, ModelTokenizer, TokenizerConfigError

USER, ASSISTANT, SYSTEM, COLON, BOS = 4, 5, 6, 7, 1


def w(n: int) -> int:
    return n + 8


def _build(root: Path, name: str, *, template: str | None = None, bos: bool = False) -> Path:
    out = root / name
    out.mkdir()
    build_tokenizer(out, 512)
    if bos:  # a BOS post-processor, like most real tokenizers: add_special_tokens then matters
        from tokenizers import Tokenizer
        from tokenizers.processors import TemplateProcessing

        raw = Tokenizer.from_file(str(out / "tokenizer.json"))
        raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
        raw.save(str(out / "tokenizer.json"))
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "dev": _build(root, "dev"),
        "bos": _build(root, "bos", bos=True),
        "kwargs": _build(
            root,
            "kwargs",
            template=(
                "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
                "{% if shout %}w99 {% endif %}{% if add_generation_prompt %}assistant : {% endif %}"
            ),
        ),
        # Iterates over content but prints the same for string and list-of-parts content.
        "both_formats": _build(
            root,
            "both",
            template=(
                "{% for m in messages %}{{ m.role }} : {% if m.content is string %}{{ m.content }}"
                "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %} \n{% endfor %}"
            ),
        ),
        # Iterates over content and prints it differently per format: only vLLM knows which it uses.
        "parts_only": _build(
            root,
            "parts",
            template=(
                "{% for m in messages %}{{ m.role }} : {% for p in m['content'] %}{{ p }}{% endfor %} \n{% endfor %}"
            ),
        ),
    }


@pytest.fixture(scope="module")
def tokenizers(dirs: dict[str, Path]) -> dict[str, ModelTokenizer]:
    return {name: ModelTokenizer(name, path) for name, path in dirs.items()}


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


CONVERSATION = chat(("system", "w1 w2"), ("user", "w3"), ("assistant", "w4 w5"), ("user", "w6"))
CONVERSATION_IDS = [SYSTEM, COLON, w(1), w(2), USER, COLON, w(3), ASSISTANT, COLON, w(4), w(5), USER, COLON, w(6)]


def test_chat_renders_template_with_generation_prompt_by_default(tokenizers: dict[str, ModelTokenizer]) -> None:
    assert tokenizers["dev"].ids("chat", CONVERSATION) == [*CONVERSATION_IDS, ASSISTANT, COLON]


def test_chat_without_generation_prompt(tokenizers: dict[str, ModelTokenizer]) -> None:
    body = {**CONVERSATION, "add_generation_prompt": False}
    assert tokenizers["dev"].ids("chat", body) == CONVERSATION_IDS


def test_chat_continue_final_message(tokenizers: dict[str, ModelTokenizer]) -> None:
    body = chat(("user", "w3"), ("assistant", "w4"), add_generation_prompt=False, continue_final_message=True)
    assert tokenizers["dev"].ids("chat", body) == [USER, COLON, w(3), ASSISTANT, COLON, w(4)]
    # vLLM leaves add_generation_prompt at its default (true) here, which the template call rejects.
    assert tokenizers["dev"].ids("chat", chat(("user", "w3"), continue_final_message=True)) is None


def test_chat_text_parts_are_joined_by_newlines(tokenizers: dict[str, ModelTokenizer]) -> None:
    body = chat(("user", [{"type": "text", "text": "w1"}, {"type": "text", "text": "w2"}]), add_generation_prompt=False)
    assert tokenizers["dev"].ids("chat", body) == [USER, COLON, w(1), w(2)]


def test_special_tokens_defaults_differ_for_chat_and_completions(tokenizers: dict[str, ModelTokenizer]) -> None:
    bos = tokenizers["bos"]
    body = chat(("user", "w1"), add_generation_prompt=False)
    assert bos.ids("chat", body) == [USER, COLON, w(1)]
    assert bos.ids("chat", {**body, "add_special_tokens": True}) == [BOS, USER, COLON, w(1)]
    assert bos.ids("completion", {"prompt": "w1 w2"}) == [BOS, w(1), w(2)]
    assert bos.ids("completion", {"prompt": "w1 w2", "add_special_tokens": False}) == [w(1), w(2)]


def test_chat_template_kwargs_reach_the_template(tokenizers: dict[str, ModelTokenizer]) -> None:
    body = chat(("user", "w1"), add_generation_prompt=False)
    assert tokenizers["kwargs"].ids("chat", body) == [USER, COLON, w(1)]
    assert tokenizers["kwargs"].ids("chat", {**body, "chat_template_kwargs": {"shout": True}}) == [
        USER,
        COLON,
        w(1),
        w(99),
    ]
    # vLLM drops null/"auto" values, and the body's own add_generation_prompt wins over the kwargs'.
    kwargs = {"shout": None, "add_generation_prompt": True}
    assert tokenizers["kwargs"].ids("chat", {**body, "chat_template_kwargs": kwargs}) == [USER, COLON, w(1)]


def test_template_looping_over_content_is_used_only_when_formats_agree(tokenizers: dict[str, ModelTokenizer]) -> None:
    body = chat(("user", "w1 w2"))
    assert tokenizers["both_formats"].template_loops_content
    assert tokenizers["both_formats"].ids("chat", body) == [USER, COLON, w(1), w(2)]
    assert tokenizers["parts_only"].template_loops_content
    assert tokenizers["parts_only"].ids("chat", body) is None
    assert not tokenizers["dev"].template_loops_content


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({**CONVERSATION, "tools": [{"type": "function", "function": {"name": "f"}}]}, id="tools"),
        pytest.param({**CONVERSATION, "chat_template": "{{ messages }}"}, id="request-template"),
        pytest.param(chat(("user", [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}])), id="image-part"),
        pytest.param(chat(("user", [{"type": "text", "text": "w1", "cache": 1}])), id="extra-part-field"),
        pytest.param(chat(("tool", "w1")), id="tool-role"),
        pytest.param(chat(("developer", "w1")), id="developer-role"),
        pytest.param(chat(("assistant", None)), id="null-content"),
        pytest.param({"messages": [{"role": "assistant", "content": "w1", "tool_calls": []}]}, id="tool-calls"),
        pytest.param(chat(("system", "x-anthropic-billing-header: cch=1\nw1")), id="billing-header"),
        pytest.param({**CONVERSATION, "chat_template_kwargs": {"tokenize": True}}, id="kwargs-tokenize"),
        pytest.param({**CONVERSATION, "chat_template_kwargs": {"documents": []}}, id="kwargs-documents"),
        pytest.param({**CONVERSATION, "chat_template_kwargs": "x"}, id="kwargs-not-object"),
        pytest.param({**CONVERSATION, "add_generation_prompt": "yes"}, id="flag-not-bool"),
        pytest.param({"messages": []}, id="no-messages"),
    ],
)
def test_chat_requests_left_to_the_engine(tokenizers: dict[str, ModelTokenizer], body: dict[str, Any]) -> None:
    assert tokenizers["dev"].ids("chat", body) is None


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": ["w1"]}, {"prompt": "w1", "add_special_tokens": 1}])
def test_completion_requests_left_to_the_engine(tokenizers: dict[str, ModelTokenizer], body: dict[str, Any]) -> None:
    assert tokenizers["dev"].ids("completion", body) is None


async def test_long_prompts_on_the_worker_thread_give_the_same_ids(dirs: dict[str, Path]) -> None:
    body = chat(("user", " ".join(f"w{i % 400}" for i in range(2000))))
    inline = LocalTokenizers({"m": dirs["dev"]})
    offloaded = LocalTokenizers({"m": dirs["dev"]}, offload_chars=100)
    full = LocalTokenizers({"m": dirs["dev"]}, offload_chars=100, max_offloaded=0)
    try:
        ids = await inline.ids("m", "chat", body)
        assert ids is not None and len(ids) == 2004
        assert await offloaded.ids("m", "chat", body) == ids
        assert await full.ids("m", "chat", body) is None  # queue full: P's /tokenize instead
        assert await inline.ids("other-model", "chat", body) is None
    finally:
        for t in (inline, offloaded, full):
            t.close()


async def test_the_event_loop_runs_while_a_long_prompt_encodes_on_the_worker_thread(dirs: dict[str, Path]) -> None:
    """The worker thread must release the GIL while it encodes (``encode_batch``; ``encode`` holds it): otherwise
    every other turn on the loop stands still for the whole encoding, as it did inline."""
    tokenizers = LocalTokenizers({"m": dirs["dev"]})
    body = {"prompt": " ".join(f"w{i % 400}" for i in range(200_000)), "add_special_tokens": False}
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0.01)
        before = ticks
        ids = await tokenizers.ids("m", "completion", body)
        during = ticks - before
    finally:
        ticker.cancel()
        tokenizers.close()
    assert ids is not None and len(ids) == 200_000
    # Measured: ~140 ticks with the GIL released, 3 with it held (the Python steps around the encoding).
    assert during >= 20, f"the loop ran {during} times while ~200K tokens were encoded"


def test_missing_directory_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="is not a directory"):
        GatewaySettings(tokenizers={"m": tmp_path / "absent"})


def test_settings_from_env_json(monkeypatch: pytest.MonkeyPatch, dirs: dict[str, Path]) -> None:
    monkeypatch.setenv("KVBRIDGE_GATEWAY_TOKENIZERS", json.dumps({"tiny": str(dirs["dev"])}))
    assert GatewaySettings().tokenizers == {"tiny": dirs["dev"]}


def test_directory_without_tokenizer_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(TokenizerConfigError, match="cannot load a tokenizer"):
        LocalTokenizers({"m": tmp_path})


def test_processor_directory_is_refused(tmp_path: Path) -> None:
    path = _build(tmp_path, "mm")
    (path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(TokenizerConfigError, match=r"preprocessor_config\.json"):
        LocalTokenizers({"m": path})


async def test_gateway_does_not_start_with_a_broken_tokenizer(tmp_path: Path) -> None:
    from kvbridge_services.common.auth import Authenticator
    from kvbridge_services.gateway.app import GatewayApp

    settings = GatewaySettings(
        http_port=0, grpc_port=0, registry_address="", lease_address="", tokenizers={"m": tmp_path}
    )
    with pytest.raises(TokenizerConfigError):
        GatewayApp(settings, auth=Authenticator({}))


@pytest.mark.parametrize("text", ["w1 w2", "  <s> w3 </s>\n\tunknown w4 ", "", "<pad><unk>"])
@pytest.mark.parametrize("add_special", [True, False])
def test_encoding_equals_the_hf_call_vllm_makes(
    dirs: dict[str, Path], tokenizers: dict[str, ModelTokenizer], text: str, add_special: bool
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(dirs["bos"]), local_files_only=True)
    expected = hf(text, add_special_tokens=add_special, truncation=False)["input_ids"]
    assert tokenizers["bos"].encode(text, add_special)[0] == expected
