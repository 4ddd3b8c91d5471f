"""The compact hash record an entry persists, and prefix verification against it.

A registration carries one 16-byte hash per full block; the registry keeps
  - every ``stride``-th hash below the *tail* (checkpoint i is the hash of block (i+1)*stride-1),
  - every hash of the tail: the blocks [tail_start, blocks-1), tail_start a multiple of stride, at most
    ``tail_blocks`` + stride - 1 of them (docs/adr/0018: where consecutive turns of a conversation diverge),
  - and the final one.
24K tokens at block size 16 is 1,536 blocks: 24 KiB of hashes in full, ~7.7 KiB with stride 4 and a
128-block tail.

Verification relies on the chain being cumulative (each hash covers all earlier
blocks): equality at block j implies equality at every block below j. So:
  1. the prompt agrees at the entry's final block -> the whole entry is reusable
     (append-only history, the common case, one comparison);
  2. else binary-search the tail -> the longest common prefix, exact to the block, when it ends in the tail;
  3. else binary-search the checkpoints -> the longest checkpoint-aligned prefix.
Every block answered is one whose full 16-byte hash matched (no truncated hashes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

HASH_SIZE = 16


@dataclass(frozen=True, slots=True)
class HashRecord:
    stride: int
    # A tuple, or the stored proto's repeated field itself (no second copy of the hashes in memory).
    checkpoints: Sequence[bytes]
    final: bytes
    # Number of full blocks the chain covered.
    blocks: int
    # Hashes of blocks tail_start .. blocks-2 (every block); empty: no tail, checkpoints cover the chain.
    tail: Sequence[bytes] = ()
    tail_start: int = 0

    @classmethod
    def from_chain(cls, hashes: Sequence[bytes], stride: int, tail_blocks: int = 0) -> HashRecord:
        """Keeps every ``stride``-th hash, every hash of the last ``tail_blocks`` (rounded out to a
        stride boundary) and the final one."""
        if not hashes or stride < 1 or tail_blocks < 0:
            raise ValueError("a hash record needs at least one block, stride >= 1 and tail_blocks >= 0")
        blocks = len(hashes)
        tail_start = max(0, (blocks - tail_blocks) // stride * stride) if tail_blocks else blocks
        if tail_start >= blocks - 1:  # nothing between the checkpoints and the final block: no tail
            return cls(stride=stride, checkpoints=tuple(hashes[stride - 1 :: stride]), final=hashes[-1], blocks=blocks)
        checkpoints = tuple(hashes[stride - 1 : tail_start : stride])
        return cls(
            stride=stride,
            checkpoints=checkpoints,
            final=hashes[-1],
            blocks=blocks,
            tail=tuple(hashes[tail_start : blocks - 1]),
            tail_start=tail_start,
        )

    @classmethod
    def from_stored(
        cls,
        checkpoints: Sequence[bytes],
        stride: int,
        final: bytes,
        blocks: int,
        tail_packed: bytes = b"",
        tail_start: int = 0,
    ) -> HashRecord:
        """From persisted fields; ``blocks`` is recovered by the caller (see entrylookup.record_of).

        A tail that does not end right below the final block (a damaged or foreign record) is dropped:
        the checkpoints alone still verify correctly, only more coarsely."""
        tail: Sequence[bytes] = ()
        if (
            tail_packed
            and len(tail_packed) % HASH_SIZE == 0
            and tail_start % stride == 0
            and tail_start + len(tail_packed) // HASH_SIZE == blocks - 1
        ):
            tail = PackedChain(tail_packed, HASH_SIZE)
            if len(checkpoints) > tail_start // stride:
                checkpoints = checkpoints[: tail_start // stride]
        else:
            tail_start = 0
        return cls(stride=stride, checkpoints=checkpoints, final=final, blocks=blocks, tail=tail, tail_start=tail_start)

    def packed_tail(self) -> bytes:
        return b"".join(self.tail)

    def positions(self) -> list[tuple[int, bytes]]:
        """(block index, hash) of every hash kept: checkpoints, the tail, then the final block."""
        out = [((i + 1) * self.stride - 1, h) for i, h in enumerate(self.checkpoints)]
        out += [(self.tail_start + i, h) for i, h in enumerate(self.tail)]
        if not out or out[-1][0] != self.blocks - 1:
            out.append((self.blocks - 1, self.final))
        return out

    def verified_blocks(self, prompt: Sequence[bytes]) -> int:
        """Leading blocks of ``prompt`` (its full chain) proven equal to this record's chain."""
        last = self.blocks - 1
        if len(prompt) > last and prompt[last] == self.final:
            return self.blocks
        tail = self.tail
        if tail and len(prompt) > self.tail_start and prompt[self.tail_start] == tail[0]:
            # The prompt matches into the tail: the deepest tail block it matches, exactly.
            lo, hi = 1, min(len(tail), len(prompt) - self.tail_start)  # lo tail hashes known equal
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if prompt[self.tail_start + mid - 1] == tail[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            return self.tail_start + lo
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
    return HASH_SIZE * (len(record.checkpoints) + len(record.tail) + 1)
