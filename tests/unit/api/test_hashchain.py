from __future__ import annotations

import random

import pytest

from kvbridge import hashchain as hc

S = b"0123456789abcdef"
ARGS = (S, "acme", "m", "", 4)


def test_only_full_blocks_are_hashed() -> None:
    assert hc.chain(*ARGS, []) == []
    assert hc.chain(*ARGS, [1, 2, 3]) == []
    assert len(hc.chain(*ARGS, list(range(11)))) == 2
    assert all(len(h) == 16 for h in hc.chain(*ARGS, list(range(40))))


def test_prefix_property_and_scoping() -> None:
    base = hc.chain(*ARGS, list(range(40)))
    assert hc.chain(*ARGS, list(range(20))) == base[:5]
    for other in [
        (S, "other", "m", "", 4),
        (S, "acme", "m2", "", 4),
        (S, "acme", "m", "salt", 4),
        (b"fedcba9876543210", "acme", "m", "", 4),
    ]:
        assert hc.chain(*other, list(range(40)))[0] != base[0]
    # Length prefixing: ("ab", "c") and ("a", "bc") must not collide.
    assert hc.seed(S, "ab", "c", "", 4) != hc.seed(S, "a", "bc", "", 4)
    assert hc.seed(S, "acme", "m", "", 4) != hc.seed(S, "acme", "m", "", 8)


def test_extend_equals_full_chain() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(2**32) for _ in range(203)]
    for cut in (0, 3, 4, 57, 200):
        prior = hc.chain(*ARGS, tokens[:cut])
        assert hc.extend(*ARGS, prior, tokens) == hc.chain(*ARGS, tokens)
    with pytest.raises(ValueError):
        hc.extend(*ARGS, hc.chain(*ARGS, tokens), tokens[:8])


def test_common_prefix_blocks() -> None:
    a = hc.chain(*ARGS, list(range(64)))
    for edit in range(64):
        tokens = list(range(64))
        tokens[edit] = 99999
        b = hc.chain(*ARGS, tokens)
        assert hc.common_prefix_blocks(a, b) == edit // 4
    assert hc.common_prefix_blocks(a, a) == 16
    assert hc.common_prefix_blocks(a, a[:5]) == 5
    assert hc.common_prefix_blocks([], a) == 0


def test_validation() -> None:
    with pytest.raises(ValueError):
        hc.chain(b"short", "t", "m", "", 4, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        hc.chain(b"x" * 65, "t", "m", "", 4, [1, 2, 3, 4])
    with pytest.raises(TypeError):
        hc.check_secret("not-bytes-0123456789")  # type: ignore[arg-type]
    for bad_block in (0, 1025):
        with pytest.raises(ValueError):
            hc.chain(S, "t", "m", "", bad_block, [1])
    for bad_token in (-1, 2**32):
        with pytest.raises(ValueError):
            hc.chain(*ARGS, [1, 2, 3, bad_token])


def test_prefix_digest_covers_exactly_the_first_k_tokens() -> None:
    tokens = list(range(100, 164))
    d = hc.prefix_digest(tokens, 32)
    assert d == hc.prefix_digest([*tokens[:32], 9, 9, 9], 32)  # later tokens don't matter
    assert d != hc.prefix_digest(tokens, 31) != hc.prefix_digest(tokens, 33)
    edited = [*tokens[:31], 7, *tokens[32:]]
    assert hc.prefix_digest(edited, 32) != d and hc.prefix_digest(edited, 31) == hc.prefix_digest(tokens, 31)
    for bad in (0, 65):
        with pytest.raises(ValueError):
            hc.prefix_digest(tokens, bad)


def test_an_array_of_uint32_hashes_like_the_same_ids_as_a_list() -> None:
    """The gateway hands its tokenizer's ``array("I")`` on without converting it: same bytes, chain and digest."""
    from array import array

    rng = random.Random(11)
    tokens = [rng.randrange(2**32) for _ in range(203)]
    packed = array("I", tokens)
    assert hc.token_bytes(packed) == hc.token_bytes(tokens) == b"".join(t.to_bytes(4, "little") for t in tokens)
    assert hc.chain(*ARGS, packed) == hc.chain(*ARGS, tokens)
    assert hc.extend(*ARGS, hc.chain(*ARGS, tokens[:57]), packed) == hc.chain(*ARGS, tokens)
    assert hc.prefix_digest(packed, 150) == hc.prefix_digest(tokens, 150)
    with pytest.raises(ValueError):
        hc.token_bytes([2**32])
