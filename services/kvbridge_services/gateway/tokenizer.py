"""Prompt token ids computed in the gateway with the model's own HF tokenizer and chat template.

This saves the turn's ``/tokenize`` round trip to P. The ids must equal what vLLM 0.32's ``/tokenize``
returns for the same request body, so only requests whose rendering is fully reproduced here are
tokenized locally; anything else (tools, a request-supplied template, non-text content, roles or message
fields vLLM rewrites, template errors) answers ``None`` and the router asks P's ``/tokenize`` instead.

What vLLM does for ``/tokenize`` (vllm/entrypoints/serve/tokenize, vllm/renderers): chat bodies are
rendered by the tokenizer's chat template to text (``add_generation_prompt`` default true,
``continue_final_message`` default false, request ``chat_template_kwargs`` under them), then encoded
with ``add_special_tokens`` default **false**; completion prompts are encoded with ``add_special_tokens``
default **true**. Messages reach the template with string content when the template does not iterate
over ``content`` (vLLM's "string" content format); for templates that do, vLLM may pass a list of text
parts instead, so those turns are rendered both ways and used only when the two renderings agree.

Even a wrong id here cannot make P load KV for other tokens: P's connector checks the prefix digest of
the verified tokens against its own prompt before pulling (``docs/gateway.md``, "Tokenization").
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
from array import array
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.parser
from jinja2 import nodes

from .prefixcache import PrefixCache, encoded

log = logging.getLogger(__name__)

ATTR_TOKENIZE_PATH = "kvbridge.tokenize.path"  # turn span attribute: local (this module) | engine (P's /tokenize)
# Encoding costs ~0.1 ms per call plus ~0.2 us per character (fast tokenizer, dev tokenizer; 96k characters took
# 18 ms): past ~1 ms, i.e. this many characters to encode, the encoding runs on the worker thread.
OFFLOAD_CHARS = 4096
# Previous prompt encodings kept for the next turn (prefixcache): bytes over all models, conversations per model.
PREFIX_CACHE_BYTES = 256 * 1024 * 1024
PREFIX_CACHE_CONVERSATIONS = 100_000
# Turns waiting for the worker thread beyond this go to P's /tokenize instead (the queue stays bounded).
MAX_OFFLOADED = 32
_CHAT_ROLES = frozenset({"system", "user", "assistant"})  # developer/tool/function: vLLM rewrites them
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips this line from system messages
_UNSET = (None, "auto")  # chat_template_kwargs values vLLM drops (merge_kwargs)
# Files that make vLLM pick a template or tokenizer other than the HF tokenizer's own.
_UNSUPPORTED_FILES = ("processor_config.json", "preprocessor_config.json", "tekken.json")


class TokenizerConfigError(ValueError):
    """A configured tokenizer directory that cannot serve (reported at start)."""


class _GenerationTag(jinja2.ext.Extension):
    """Parses HF's ``{% generation %}...{% endgeneration %}`` blocks (assistant masks) so templates using them load."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads it from the class

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def loops_over_content(template: str) -> bool:
    """True when some ``{% for %}`` iterates over message content (or over a macro argument, which may carry it).

    vLLM's content-format detection answers "openai" (content as a list of parts) only for such loops, so a
    template without any renders exactly as vLLM renders it when given plain string content.
    """
    env = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols, jinja2.ext.do])
    root = env.parse(template)
    macro_args = {arg.name for macro in root.find_all(nodes.Macro) for arg in macro.args}
    for loop in root.find_all(nodes.For):
        for node in [loop.iter, *loop.iter.find_all(nodes.Node)]:
            if isinstance(node, nodes.Getattr) and node.attr == "content":
                return True
            if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content":
                return True
            if isinstance(node, nodes.Name) and (node.name == "content" or node.name in macro_args):
                return True
    return False


class ModelTokenizer:
    """One model's tokenizer: ``ids(kind, body)`` → token ids exactly as vLLM's /tokenize, or None."""

    def __init__(self, model: str, path: Path) -> None:
        self.model = model
        self.path = path
        if not path.is_dir():
            raise TokenizerConfigError(f"tokenizers[{model!r}]: {str(path)!r} is not a directory")
        odd = [name for name in _UNSUPPORTED_FILES if (path / name).exists()]
        if odd:
            raise TokenizerConfigError(
                f"tokenizers[{model!r}]: {path} has {', '.join(odd)}: vLLM would not use "
                "the plain HF tokenizer and chat template there; leave this model out"
            )
        try:
            from transformers import AutoTokenizer

            self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # any loader failure is a configuration error
            raise TokenizerConfigError(f"tokenizers[{model!r}]: cannot load a tokenizer from {path}: {exc}") from exc
        if not getattr(self._tok, "is_fast", False):
            raise TokenizerConfigError(f"tokenizers[{model!r}]: {path} has no fast tokenizer (tokenizer.json)")
        self._worker_tok: Any = copy.deepcopy(self._tok)  # HF tokenizers keep per-call state: one per thread
        for tok in (self._tok, self._worker_tok):
            _prepare_backend(tok)
        self.template: str | None = None
        self.template_loops_content = False
        try:
            self.template = str(self._tok.get_chat_template(None, tools=None))
            self.template_loops_content = loops_over_content(self.template)
        except Exception as exc:  # noqa: BLE001 - no template, or one jinja cannot parse: chat turns use /tokenize
            log.warning(
                "tokenizers[%r]: no usable chat template in %s (%s): chat turns use P's /tokenize", model, path, exc
            )
            self.template = None
        # Keys of apply_chat_template itself: in chat_template_kwargs they change more than the template's vars.
        self._reserved_kwargs = frozenset(inspect.signature(self._tok.apply_chat_template).parameters) | {
            "messages",
            "conversation",
        }

    def ids(self, kind: str, body: Mapping[str, Any]) -> list[int] | None:
        """``prepare`` then ``encode``, in this thread (tests; the gateway goes through LocalTokenizers)."""
        prepared = self.prepare(kind, body)
        if prepared is None:
            return None
        return self.encode(*prepared)[0]

    def prepare(self, kind: str, body: Mapping[str, Any]) -> tuple[str, bool] | None:
        """(text to encode, add_special_tokens) as vLLM would encode them, or None (ask P)."""
        if kind == "chat":
            return self._chat_text(body)
        prompt = body.get("prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not prompt or not isinstance(add_special, bool):
            return None
        return prompt, add_special

    def encode(self, text: str, add_special: bool, *, on_worker: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and each token's end offset in ``text``."""
        # vLLM calls tok(text, add_special_tokens=..., truncation=False), i.e. the Rust backend's encode_batch
        # on [text] with no truncation or padding: the same ids as its encode() (set up by _prepare_backend).
        # Inline (short texts): encode(), without encode_batch's thread-pool hand-off (~0.3 ms per call measured
        # on a busy 2-core host). On the worker thread: encode_batch, the one that releases the GIL while it
        # runs; encode() holds it, so the event loop (every other turn) stood still for the whole encoding
        # (~130 ms at 120K tokens) although it ran on another thread.
        if on_worker:
            enc = self._worker_tok.backend_tokenizer.encode_batch([text], add_special_tokens=add_special)[0]
        else:
            enc = self._tok.backend_tokenizer.encode(text, add_special_tokens=add_special)
        return list(enc.ids), [end for _, end in enc.offsets]

    # -- chat ---------------------------------------------------------------------------------
    def _chat_text(self, body: Mapping[str, Any]) -> tuple[str, bool] | None:
        if self.template is None or body.get("tools") is not None or body.get("chat_template") is not None:
            return None
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False)
        add_special = body.get("add_special_tokens", False)
        if not all(isinstance(v, bool) for v in (add_generation_prompt, continue_final, add_special)):
            return None
        kwargs = self._template_kwargs(body.get("chat_template_kwargs"))
        texts = _message_texts(body.get("messages"))
        if kwargs is None or texts is None:
            return None
        render = self._renderer(add_generation_prompt, continue_final, kwargs)
        text = render(_as_strings(texts))
        if text is not None and self.template_loops_content and render(_as_parts(texts)) != text:
            return None  # the template tells the two content formats apart: only vLLM knows which it uses
        return None if text is None else (text, add_special)

    def _template_kwargs(self, raw: object) -> dict[str, Any] | None:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            return None
        kwargs = {k: v for k, v in raw.items() if v not in _UNSET}
        # The body's own fields win over these two (vLLM merges them last).
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        if any(not isinstance(k, str) or k in self._reserved_kwargs for k in kwargs):
            return None
        return kwargs

    def _renderer(
        self, add_generation_prompt: bool, continue_final: bool, kwargs: dict[str, Any]
    ) -> Callable[[list[dict[str, Any]]], str | None]:
        def render(conversation: list[dict[str, Any]]) -> str | None:
            try:
                text = self._tok.apply_chat_template(
                    conversation,
                    tools=None,
                    chat_template=self.template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    return_dict=False,
                    **kwargs,
                )
            except Exception as exc:  # noqa: BLE001 - the template rejected the request: P's /tokenize reports it
                log.debug("chat template failed for %r: %s", self.model, exc)
                return None
            return text if isinstance(text, str) else None

        return render


def _prepare_backend(tok: Any) -> None:
    """The Rust tokenizer as HF's __call__ leaves it for vLLM's calls: no truncation, no padding, and special
    tokens in the text kept whole unless the tokenizer is configured to split them."""
    backend = tok.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tok, "split_special_tokens", False))


def _message_texts(messages: object) -> list[tuple[str, list[str], str | None]] | None:
    """(role, text parts, name) per message, or None when vLLM would change the messages before templating."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for msg in messages:
        if not isinstance(msg, dict) or not set(msg) <= _MESSAGE_KEYS or msg.get("role") not in _CHAT_ROLES:
            return None
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            return None
        content = msg.get("content")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            if not content or not all(
                isinstance(p, dict)
                and set(p) == {"type", "text"}
                and p["type"] == "text"
                and isinstance(p["text"], str)
                for p in content
            ):
                return None
            parts = [p["text"] for p in content]
        else:
            return None  # null content: vLLM's handling varies by role
        if msg["role"] == "system" and any(p.startswith(_BILLING_HEADER) for p in parts):
            return None
        out.append((str(msg["role"]), parts, name))
    return out


def _message(role: str, content: object, name: str | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        msg["name"] = name
    return msg


def _as_strings(texts: list[tuple[str, list[str], str | None]]) -> list[dict[str, Any]]:
    """vLLM's "string" content format: text parts joined by newlines."""
    return [_message(role, "\n".join(parts), name) for role, parts, name in texts]


def _as_parts(texts: list[tuple[str, list[str], str | None]]) -> list[dict[str, Any]]:
    """vLLM's "openai" content format: a list of text parts."""
    return [_message(role, [{"type": "text", "text": p} for p in parts], name) for role, parts, name in texts]


class LocalTokenizers:
    """The gateway's local tokenizers by model. A conversation's turn re-encodes only what follows its
    previous turn's prompt (``prefixcache``); long texts to encode go to one worker thread (bounded queue)."""

    def __init__(
        self,
        dirs: Mapping[str, Path],
        *,
        offload_chars: int = OFFLOAD_CHARS,
        max_offloaded: int = MAX_OFFLOADED,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        prefix_cache_conversations: int = PREFIX_CACHE_CONVERSATIONS,
    ) -> None:
        self._by_model = {model: ModelTokenizer(model, Path(path)) for model, path in dirs.items()}
        self._prefixes = (
            {
                model: PrefixCache(
                    max_conversations=prefix_cache_conversations, max_bytes=prefix_cache_bytes // max(1, len(dirs))
                )
                for model in self._by_model
            }
            if prefix_cache_bytes > 0
            else {}
        )
        self._offload_chars = offload_chars
        self._max_offloaded = max_offloaded
        self._offloaded = 0
        self._pool: ThreadPoolExecutor | None = None

    def __contains__(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def reused_tokens(self) -> int:
        """Tokens taken from a conversation's previous encoding instead of encoded again (all models)."""
        return sum(p.reused_tokens for p in self._prefixes.values())

    async def ids(
        self, model: str, kind: str, body: Mapping[str, Any], conversation: Hashable | None = None
    ) -> array[int] | None:
        """Token ids as vLLM's /tokenize would return them, as an ``array("I")`` (hashed and digested without a
        per-token copy), or None (no tokenizer, unsupported request,
        or the worker thread's queue is full): then the caller asks P. ``conversation``: the turn's
        conversation identity, under which its encoding is kept for the next turn."""
        tok = self._by_model.get(model)
        if tok is None:
            return None
        prepared = tok.prepare(kind, body)
        if prepared is None:
            return None
        text, add_special = prepared
        # Only without special tokens: a post-processor's BOS/EOS would sit inside a spliced encoding.
        prefixes = self._prefixes.get(model) if conversation is not None and not add_special else None
        resume = prefixes.resume(conversation, text) if prefixes is not None else None
        if resume is not None:
            assert prefixes is not None
            tail = await self._encode(tok, text[resume.char :], add_special)
            if tail is None:
                return None
            spliced = prefixes.splice(resume, text, *tail)
            if spliced is not None and prefixes.due_for_verification():
                full = await self._encode(tok, text, add_special)
                if full is not None and full[0] != list(spliced.ids):
                    prefixes.disable(f"a spliced encoding differed from the full one ({model!r})")
                    return array("I", full[0])
            if spliced is not None:
                prefixes.store(conversation, spliced)
                return spliced.ids  # an array("I"): no list of every token built again each turn
        whole = await self._encode(tok, text, add_special)
        if whole is None:
            return None
        if prefixes is None:
            return array("I", whole[0])
        enc = encoded(text, *whole)
        prefixes.store(conversation, enc)
        return enc.ids

    async def _encode(self, tok: ModelTokenizer, text: str, add_special: bool) -> tuple[list[int], list[int]] | None:
        if len(text) < self._offload_chars:
            return tok.encode(text, add_special)
        if self._offloaded >= self._max_offloaded:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-tokenize")
        self._offloaded += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: tok.encode(text, add_special, on_worker=True)
            )
        finally:
            self._offloaded -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
