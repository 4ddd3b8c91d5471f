from __future__ import annotations

import pytest

from kvbridge import hashchain
from kvbridge_services.common.hashrecord import HashRecord, stored_bytes

S = b"0123456789abcdef"


def chain(tokens: list[int], block: int = 4) -> list[bytes]:
    return hashchain.chain(S, "t", "m", "", block, tokens)


def test_record_keeps_every_stride_th_hash_and_the_final() -> None:
    full = chain(list(range(4 * 10)))
    rec = HashRecord.from_chain(full, 4)
    assert rec.checkpoints == (full[3], full[7])
    assert rec.final == full[9] and rec.blocks == 10
    assert [p for p, _ in rec.positions()] == [3, 7, 9]
    short = HashRecord.from_chain(full[:2], 4)
    assert short.checkpoints == () and [p for p, _ in short.positions()] == [1]


@pytest.mark.parametrize("stride", [1, 2, 4, 7])
def test_verified_blocks_is_longest_checkpoint_aligned_common_prefix(stride: int) -> None:
    tokens = list(range(4 * 37))
    rec = HashRecord.from_chain(chain(tokens), stride)
    # Append-only: full reuse regardless of stride.
    assert rec.verified_blocks(chain([*tokens, *range(500, 520)])) == 37
    assert rec.verified_blocks(chain(tokens)) == 37
    for edit_block in range(37):
        edited = list(tokens)
        edited[edit_block * 4 + 2] = 99999
        common = edit_block
        assert rec.verified_blocks(chain(edited)) == (common // stride) * stride
    for cut in range(0, 37):
        # Truncated prompt: only its own full blocks can be proven, floored to a checkpoint.
        assert rec.verified_blocks(chain(tokens[: cut * 4])) == (cut // stride) * stride


def test_verified_never_exceeds_record() -> None:
    rec = HashRecord.from_chain(chain(list(range(8))), 4)
    assert rec.verified_blocks(chain(list(range(64)))) == 2


@pytest.mark.parametrize(("tokens", "expected"), [(2048, 528), (8192, 2064), (24576, 6160)])
def test_stored_hash_bytes_per_entry(tokens: int, expected: int) -> None:
    # Block size 16 (vLLM default), stride 4: one checkpoint per 64 tokens + the final hash.
    blocks = tokens // 16
    rec = HashRecord.from_chain([bytes(16)] * blocks, 4)
    assert stored_bytes(rec) == expected
    assert stored_bytes(rec) < 7 * 1024


@pytest.mark.parametrize(("stride", "tail_blocks"), [(4, 8), (4, 9), (1, 3), (7, 10), (4, 200)])
def test_tail_verifies_exactly_to_the_block(stride: int, tail_blocks: int) -> None:
    tokens = list(range(4 * 37))
    full = chain(tokens)
    rec = HashRecord.from_chain(full, stride, tail_blocks)
    tail_start = max(0, (37 - tail_blocks) // stride * stride)
    assert rec.tail_start == tail_start and list(rec.tail) == full[tail_start:36]
    assert len(rec.checkpoints) == tail_start // stride
    assert [p for p, _ in rec.positions()] == [*range(stride - 1, tail_start, stride), *range(tail_start, 37)]
    for edit_block in range(37):
        edited = list(tokens)
        edited[edit_block * 4 + 2] = 99999
        # Exact in the tail, checkpoint-aligned below it; never more than the common prefix.
        want = edit_block if edit_block > tail_start else (edit_block // stride) * stride
        assert rec.verified_blocks(chain(edited)) == want
    for cut in range(37):
        want = cut if cut > tail_start else (cut // stride) * stride
        assert rec.verified_blocks(chain(tokens[: cut * 4])) == want


def test_a_three_block_match_is_a_three_block_hit() -> None:
    tokens = list(range(4 * 10))
    rec = HashRecord.from_chain(chain(tokens), 4, 128)
    assert rec.checkpoints == () and rec.tail_start == 0
    assert rec.verified_blocks(chain([*tokens[:12], 7, 7, 7, 7])) == 3
    assert HashRecord.from_chain(chain(tokens), 4).verified_blocks(chain([*tokens[:12], 7, 7, 7, 7])) == 0


def test_stored_tail_round_trips_and_a_damaged_tail_is_dropped() -> None:
    full = chain(list(range(4 * 37)))
    rec = HashRecord.from_chain(full, 4, 10)
    back = HashRecord.from_stored(list(rec.checkpoints), 4, rec.final, 37, rec.packed_tail(), rec.tail_start)
    assert back.positions() == rec.positions()
    assert stored_bytes(back) == stored_bytes(rec) == 16 * (len(rec.checkpoints) + len(rec.tail) + 1)
    edited = list(range(4 * 37))
    edited[33 * 4] = 5
    assert back.verified_blocks(chain(edited)) == 33
    # A tail that does not end below the final block is ignored: checkpoints only (coarser, still sound).
    damaged = HashRecord.from_stored(list(rec.checkpoints), 4, rec.final, 37, rec.packed_tail()[16:], rec.tail_start)
    assert damaged.tail == () and damaged.verified_blocks(chain(edited)) == rec.tail_start == 24


@pytest.mark.parametrize(("tokens", "expected"), [(2048, 2048), (8192, 3584), (24576, 7680)])
def test_stored_hash_bytes_per_entry_with_the_default_tail(tokens: int, expected: int) -> None:
    # Block size 16, stride 4, 128-block tail (the registry's defaults).
    blocks = tokens // 16
    rec = HashRecord.from_chain([bytes([i % 256]) * 16 for i in range(blocks)], 4, 128)
    assert stored_bytes(rec) == expected
