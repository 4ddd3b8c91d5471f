"""Incremental prompt encoding: a conversation's next turn encodes only its new text, and the ids stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_services.devengines.model import build_tokenizer
from kvbridge_services.gateway.prefixcache import RESYNC_TOKENS, PrefixCache, encoded
from kvbridge_services.gateway.tokenizer import LocalTokenizers


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dev-tokenizer")
    build_tokenizer(path, 512)
    return path


def words(start: int, n: int) -> str:
    return " ".join(f"w{(start + i) % 400 + 10}" for i in range(n))


async def test_each_turn_reuses_the_previous_encoding_and_equals_a_full_one(dev_dir: Path) -> None:
    cached = LocalTokenizers({"m": dev_dir})
    plain = LocalTokenizers({"m": dev_dir}, prefix_cache_bytes=0)
    msgs = [{"role": "user", "content": words(0, 150)}]
    try:
        for i in range(6):
            body = {"messages": list(msgs)}
            ids = await cached.ids("m", "chat", body, ("acme", "c1"))
            assert ids is not None and ids == await plain.ids("m", "chat", body, ("acme", "c1"))
            msgs += [{"role": "assistant", "content": words(i, 8)}, {"role": "user", "content": words(i * 3, 20)}]
        # Turns 2..6 took all but the last RESYNC_TOKENS tokens of the previous turn's ids from the cache.
        assert cached.reused_tokens() >= 5 * (150 - RESYNC_TOKENS)
        assert plain.reused_tokens() == 0
    finally:
        cached.close()
        plain.close()


async def test_an_edited_history_or_another_conversation_is_encoded_whole(dev_dir: Path) -> None:
    tokenizers = LocalTokenizers({"m": dev_dir})
    try:
        first = {"messages": [{"role": "user", "content": words(0, 100)}]}
        await tokenizers.ids("m", "chat", first, ("acme", "c1"))
        edited = {
            "messages": [
                {"role": "user", "content": "w99 " + words(1, 99)},
                {"role": "assistant", "content": "w1"},
                {"role": "user", "content": "w2"},
            ]
        }
        ids = await tokenizers.ids("m", "chat", edited, ("acme", "c1"))
        assert tokenizers.reused_tokens() == 0 and ids == await tokenizers.ids("m", "chat", edited)
        longer = {"messages": [*first["messages"], {"role": "assistant", "content": "w5"}]}
        await tokenizers.ids("m", "chat", longer, ("acme", "c2"))  # c2 has no previous turn
        assert tokenizers.reused_tokens() == 0
    finally:
        tokenizers.close()


def test_a_re_encoding_that_does_not_reproduce_the_old_tokens_is_not_spliced() -> None:
    cache = PrefixCache(max_conversations=10, max_bytes=1 << 20)
    ids = list(range(40))
    ends = [2 * i + 1 for i in range(40)]  # token i is text[2i:2i+1], a space after each
    text = " ".join("x" * 40)
    cache.store("k", encoded(text, ids, ends))
    resume = cache.resume("k", text + " y")
    assert resume is not None and resume.token == 40 - RESYNC_TOKENS and resume.char == ends[resume.token - 1]
    good = [*range(resume.token, 40), 99]
    good_ends = [*(e - resume.char for e in ends[resume.token :]), len(text) + 2 - resume.char]
    spliced = cache.splice(resume, text + " y", good, good_ends)
    assert spliced is not None and list(spliced.ids) == [*ids, 99] and spliced.ends[-1] == len(text) + 2
    assert cache.splice(resume, text + " y", [7, *good[1:]], good_ends) is None  # a different first token
    shifted = [good_ends[0] + 1, *good_ends[1:]]
    assert cache.splice(resume, text + " y", good, shifted) is None  # same ids, different boundaries
    assert cache.resume("k", "changed " + text) is None  # not a continuation


def test_the_cache_is_bounded_by_conversations_and_bytes() -> None:
    one = encoded("x " * 50, list(range(50)), list(range(1, 101, 2)))
    by_count = PrefixCache(max_conversations=2, max_bytes=1 << 20)
    for key in ("a", "b", "c"):
        by_count.store(key, one)
    assert len(by_count) == 2 and by_count.resume("a", one.text + "y") is None
    by_bytes = PrefixCache(max_conversations=100, max_bytes=one.nbytes * 3)
    for key in "abcdef":
        by_bytes.store(key, one)
    assert len(by_bytes) == 3 and by_bytes.nbytes <= one.nbytes * 3


async def test_a_splice_that_differs_from_the_full_encoding_turns_splicing_off(
    dev_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizers = LocalTokenizers({"m": dev_dir})
    cache = tokenizers._prefixes["m"]
    cache._verify_every = 1
    body = {"messages": [{"role": "user", "content": words(0, 60)}]}
    try:
        await tokenizers.ids("m", "chat", body, ("acme", "c1"))
        real_splice = PrefixCache.splice

        def corrupt(self: PrefixCache, *args: object) -> object:
            out = real_splice(self, *args)  # type: ignore[arg-type]
            if out is not None:
                out.ids[0] = 3  # what a tokenizer whose tokens depend on later text could produce
            return out

        monkeypatch.setattr(PrefixCache, "splice", corrupt)
        longer = {"messages": [*body["messages"], {"role": "assistant", "content": "w1"}]}
        ids = await tokenizers.ids("m", "chat", longer, ("acme", "c1"))
        assert ids == await LocalTokenizers({"m": dev_dir}, prefix_cache_bytes=0).ids("m", "chat", longer)
        assert not cache.enabled and len(cache) == 0
    finally:
        tokenizers.close()


async def test_byte_level_bpe_with_special_tokens_splices_exactly(tmp_path: Path) -> None:
    """A GPT-style tokenizer (byte-level BPE, ChatML special tokens between messages) over varied text:
    unicode, tabs, newlines, repeated spaces, code. Every turn's spliced ids equal a full encoding."""
    import random

    from tests.fixtures.bpe_tokenizer import build_bpe_tokenizer, sample_text

    bpe = build_bpe_tokenizer(tmp_path / "bpe")
    cached = LocalTokenizers({"m": bpe})
    plain = LocalTokenizers({"m": bpe}, prefix_cache_bytes=0)
    rng = random.Random(11)
    try:
        for conv in range(12):
            msgs = [
                {"role": "system", "content": sample_text(rng, 20)},
                {"role": "user", "content": sample_text(rng, 120)},
            ]
            for _ in range(6):
                body = {"messages": list(msgs)}
                assert await cached.ids("m", "chat", body, ("acme", f"c{conv}")) == await plain.ids("m", "chat", body)
                msgs += [
                    {"role": "assistant", "content": sample_text(rng, rng.randint(1, 30))},
                    {"role": "user", "content": sample_text(rng, rng.randint(1, 40))},
                ]
        assert cached._prefixes["m"].enabled and cached.reused_tokens() > 12 * 5 * 100
    finally:
        cached.close()
        plain.close()
