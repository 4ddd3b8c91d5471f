from __future__ import annotations

import random

import pytest

from kvbridge import hashchain
from kvbridge.hashchain import token_bytes as pack
from kvbridge_services.gateway.chaincache import ChainCache, Scope, common_blocks

SECRET = b"0123456789abcdef"
SCOPE = Scope("acme", "m", "", 4)


def full(tokens: list[int], scope: Scope = SCOPE) -> list[bytes]:
    return hashchain.chain(SECRET, scope.tenant, scope.model, scope.cache_salt, scope.block_size, tokens)


def test_common_blocks_counts_equal_whole_blocks() -> None:
    a = pack(list(range(40)))
    assert common_blocks(a, a, 16) == 10
    assert common_blocks(a, pack(list(range(22))), 16) == 5  # the shorter one's whole blocks
    for at in range(40):
        b = list(range(40))
        b[at] = 999
        assert common_blocks(a, pack(b), 16) == at // 4


def test_chain_equals_the_full_computation_across_turns_and_edits() -> None:
    cache = ChainCache(SECRET, max_bytes=1 << 20)
    rng = random.Random(5)
    seq = [rng.randrange(50_000) for _ in range(203)]
    assert cache.chain(SCOPE, "c1", seq) == full(seq) and cache.reused_blocks == 0
    grown = [*seq, *range(7, 90)]
    assert cache.chain(SCOPE, "c1", grown) == full(grown)
    assert cache.reused_blocks == 203 // 4  # append-only: every old whole block reused
    edited = list(grown)
    edited[101] += 1  # block 25 changed: blocks 0..24 reused, the rest hashed again
    before = cache.reused_blocks
    assert cache.chain(SCOPE, "c1", edited) == full(edited)
    assert cache.reused_blocks - before == 25
    # Another scope (tenant, salt, block size) or conversation never reuses these hashes.
    other = Scope("beta", "m", "", 4)
    assert cache.chain(other, "c1", edited) == full(edited, other)
    salted = Scope("acme", "m", "s", 4)
    assert cache.chain(salted, "c1", edited) == full(edited, salted)
    assert cache.chain(SCOPE, "c2", edited[:50]) == full(edited[:50])


def test_no_conversation_or_off_or_over_budget_is_computed_and_bounded() -> None:
    seq = list(range(400))
    off = ChainCache(SECRET, max_bytes=0)
    assert off.chain(SCOPE, "c1", seq) == full(seq) and len(off) == 0
    cache = ChainCache(SECRET, max_bytes=8000)
    assert cache.chain(SCOPE, "", seq) == full(seq) and len(cache) == 0
    for i in range(5):
        assert cache.chain(SCOPE, f"c{i}", seq) == full(seq)
        assert cache.nbytes <= 8000
    assert len(cache) == 1  # one 400-token sequence is ~6.6 KB: older conversations were evicted


def test_ids_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        ChainCache(SECRET, max_bytes=1 << 20).chain(SCOPE, "c1", [1, 2, 3, 2**32])
