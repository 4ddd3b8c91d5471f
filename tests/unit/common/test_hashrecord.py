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
