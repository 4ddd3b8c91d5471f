"""A conversation's last hashed token sequence and its block-hash chain, so a new turn hashes only new blocks.

Hashing the whole prompt every turn costs ~0.3 µs per token (one keyed BLAKE2b call per 16-token block):
~40 ms a turn at 128K tokens, twice (the lookup hashes the prompt, the compatibility-mode registration
prompt + output). Instead the gateway keeps, per conversation, the token ids it last hashed (packed as
uint32, 4 bytes a token) with their chain, finds how many whole blocks the new sequence shares with them
(a memcmp, no Python loop over tokens) and hashes only the blocks after those (``hashchain.extend``).

Sound by construction: a block's hash is reused only when every token up to the end of that block is
byte-for-byte the one hashed before, under the same (tenant, model, cache_salt, block size) scope and the
same secret (one cache per router). Bounded LRU by bytes; 0 bytes turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge import hashchain
from kvbridge_services.common.lru import SizedLru


@dataclass(frozen=True, slots=True)
class Scope:
    tenant: str
    model: str
    cache_salt: str
    block_size: int


@dataclass(frozen=True, slots=True)
class _Hashed:
    packed: bytes  # the hashed full blocks' token ids, uint32 little-endian
    hashes: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return len(self.packed) + 49 * len(self.hashes) + 64  # 16-byte bytes objects (33 B header) + tuple slot


def common_blocks(a: bytes, b: bytes, block_bytes: int) -> int:
    """Whole blocks of ``block_bytes`` at the start of ``a`` and ``b`` that are equal (binary search, memcmp)."""
    most = min(len(a), len(b)) // block_bytes
    view = memoryview(b)
    if a.startswith(view[: most * block_bytes]):  # the common case: the new sequence extends the old one
        return most
    lo, hi = 0, most - 1  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(view[: mid * block_bytes]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChainCache:
    def __init__(self, secret: bytes, *, max_bytes: int, max_conversations: int = 100_000) -> None:
        self._secret = hashchain.check_secret(secret)
        self._max_bytes = max_bytes
        self._by_key: SizedLru[_Hashed] = SizedLru(
            max_bytes=max_bytes, max_entries=max_conversations, nbytes=lambda h: h.nbytes
        )
        self.reused_blocks = 0  # blocks whose hash came from the cache instead of being computed

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def nbytes(self) -> int:
        return self._by_key.nbytes

    def shared_blocks(self, scope: Scope, conversation: str, packed: bytes) -> int:
        """Whole blocks at the start of ``packed`` (a prompt's full blocks, ``hashchain.token_bytes``) equal to the
        conversation's last hashed ids (0: none kept)."""
        prev = self._by_key.get((scope, conversation))
        return 0 if prev is None else common_blocks(packed, prev.packed, 4 * scope.block_size)

    def chain(self, scope: Scope, conversation: str, token_ids: Sequence[int], *, base: str = "") -> list[bytes]:
        """The chain of ``token_ids`` (``hashchain.chain``), reusing the conversation's last chain where the
        tokens agree, and kept as its last chain. Without a conversation (or with the cache off): computed.
        ``base``: a conversation whose last chain to reuse when this one has none kept (a keyless thread's fork)."""
        b = scope.block_size
        if not conversation or self._max_bytes <= 0:
            return hashchain.chain(self._secret, scope.tenant, scope.model, scope.cache_salt, b, token_ids)
        full = len(token_ids) // b
        packed = hashchain.token_bytes(token_ids[: full * b])
        key = (scope, conversation)
        prev = self._by_key.get(key)
        if prev is None and base:
            prev = self._by_key.get((scope, base))
        reuse = common_blocks(packed, prev.packed, 4 * b) if prev is not None else 0
        if reuse:
            assert prev is not None
            hashes = hashchain.extend(
                self._secret, scope.tenant, scope.model, scope.cache_salt, b, prev.hashes[:reuse], token_ids
            )
            self.reused_blocks += reuse
        else:
            hashes = hashchain.chain(self._secret, scope.tenant, scope.model, scope.cache_salt, b, token_ids)
        self._by_key.put(key, _Hashed(packed, tuple(hashes)))
        return hashes
