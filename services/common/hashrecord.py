"""The compact hash record an entry persists, and prefix verification against it.

A registration carries one 16-byte hash per full block; the registry keeps only
every ``stride``-th hash (checkpoint i is the hash of block (i+1)*stride-1) and
the final one. 24K tokens at block size 16 is 1,536 blocks: 24 KiB of hashes in
full, ~6 KiB with stride 4.

Verification relies on the chain being cumulative (each hash covers all earlier
blocks): equality at block j implies equality at every block below j. So:
  1. the prompt agrees at the entry's final block -> the whole entry is reusable
     (append-only history, the common case, one comparison);
  2. else binary-search the checkpoints -> the longest checkpoint-aligned prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True, slots=True)
class HashRecord:
    stride: int
    # A tuple, or the stored proto's repeated field itself (no second copy of the hashes in memory).
    checkpoints: Sequence[bytes]
    final: bytes
    # Number of full blocks the chain covered.
    blocks: int

    @classmethod
    def from_chain(cls, hashes: Sequence[bytes], stride: int) -> HashRecord:
        if not hashes or stride < 1:
            raise ValueError("a hash record needs at least one block and stride >= 1")
        checkpoints = tuple(hashes[stride - 1 :: stride])
        return cls(stride=stride, checkpoints=checkpoints, final=hashes[-1], blocks=len(hashes))

    @classmethod
    def from_stored(cls, checkpoints: Sequence[bytes], stride: int, final: bytes, blocks: int) -> HashRecord:
        """From persisted fields; ``blocks`` is recovered by the caller (see blocks_from_stored)."""
        return cls(stride=stride, checkpoints=checkpoints, final=final, blocks=blocks)

    def positions(self) -> list[tuple[int, bytes]]:
        """(block index, hash) of every hash kept: checkpoints, then the final block."""
        out = [((i + 1) * self.stride - 1, h) for i, h in enumerate(self.checkpoints)]
        if not out or out[-1][0] != self.blocks - 1:
            out.append((self.blocks - 1, self.final))
        return out

    def verified_blocks(self, prompt: Sequence[bytes]) -> int:
        """Leading blocks of ``prompt`` (its full chain) proven equal to this record's chain."""
        last = self.blocks - 1
        if len(prompt) > last and prompt[last] == self.final:
            return self.blocks
        # Checkpoints the prompt is long enough to be compared at.
        usable = min(len(self.checkpoints), len(prompt) // self.stride)
        lo, hi = 0, usable  # lo checkpoints known equal; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prompt[mid * self.stride - 1] == self.checkpoints[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.stride


class PackedChain(Sequence[bytes]):
    """A block-hash chain sent packed (fixed-size hashes back to back), read without splitting it.

    Verification looks at a handful of positions (the final block, then a binary search
    over checkpoints), so slicing on access beats materialising one bytes object per block.
    """

    __slots__ = ("_len", "_raw", "_size")

    def __init__(self, raw: bytes, hash_size: int) -> None:
        if hash_size < 1 or len(raw) % hash_size:
            raise ValueError("packed chain length must be a multiple of the hash size")
        self._raw, self._size, self._len = raw, hash_size, len(raw) // hash_size

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("block index out of range")
        start = index * self._size
        return self._raw[start : start + self._size]


def stored_bytes(record: HashRecord) -> int:
    """Hash bytes persisted for one entry."""
    return 16 * (len(record.checkpoints) + 1)
