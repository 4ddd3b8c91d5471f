"""The block-hash chain: one definition shared by gateway, registry and connector.

Exact definition (docs/hash-chain.md has the same text and test vectors):

    H(x)     = BLAKE2b(x, digest_size=16, key=secret)           secret: 16..64 bytes
    lp(s)    = uint32_le(len(utf8(s))) || utf8(s)
    seed     = H(lp(DOMAIN_TAG) || lp(tenant) || lp(model) || lp(cache_salt) || uint32_le(block_size))
    hash_0   = H(seed || tokens[0:B] as uint32_le each)
    hash_i   = H(hash_{i-1} || tokens[i*B:(i+1)*B] as uint32_le each)

Only full blocks are hashed. Because every hash covers its predecessor, two
chains equal at block i are equal at every block below i (up to collisions of
a keyed 128-bit hash), which is what lets the registry binary-search them.

The prompt-prefix digest (``prefix_digest``) is the unkeyed check prefill runs
before it pulls: the gateway verified tokens[0:K] against D's chain, and P
recomputes the digest over its own prompt's first K tokens, so P never loads
KV for tokens that differ from the ones verified (e.g. if the gateway's and P's
tokenizations ever disagreed):

    digest = hex(SHA-256(lp(PREFIX_DIGEST_TAG) || uint32_le(K) || tokens[0:K] as uint32_le each))
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

DOMAIN_TAG = "kvbridge.block-hash-chain.v1"
PREFIX_DIGEST_TAG = "kvbridge.prompt-prefix.v1"
# The kv_transfer_params field the gateway sends the digest in and P's connector checks.
KV_PARAMS_PREFIX_DIGEST = "kvbridge_prefix_digest"
HASH_BYTES = 16
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 64  # BLAKE2b's maximum key length
MAX_BLOCK_SIZE = 1024
_MAX_TOKEN_ID = 2**32 - 1
_U32 = struct.Struct("<I")


def check_secret(secret: bytes) -> bytes:
    """The secret itself, if it is usable as the chain key; ValueError otherwise."""
    if not isinstance(secret, bytes | bytearray):
        raise TypeError("the hash-chain secret must be bytes")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(
            f"the hash-chain secret must be {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes, got {len(secret)}"
        )
    return bytes(secret)


def _lp(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U32.pack(len(raw)) + raw


def _check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be 1..{MAX_BLOCK_SIZE}, got {block_size}")


def _h(secret: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES, key=secret).digest()


def seed(secret: bytes, tenant: str, model: str, cache_salt: str, block_size: int) -> bytes:
    """The chain's starting value: scopes every hash by tenant, model, cache_salt and block size."""
    key = check_secret(secret)
    _check_block_size(block_size)
    data = _lp(DOMAIN_TAG) + _lp(tenant) + _lp(model) + _lp(cache_salt) + _U32.pack(block_size)
    return _h(key, data)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian (the chain's layout); ValueError for an id outside 0..2^32-1.

    An ``array("I")`` of 4-byte items (what the gateway's tokenizer produces) is copied as it is on a
    little-endian host: no Python work per token, which at agent context lengths is most of a turn's hashing."""
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4 and sys.byteorder == "little":
        return tokens.tobytes()
    try:
        packed = array("I", tokens) if array("I").itemsize == 4 else array("L", tokens)
    except OverflowError:
        raise ValueError(f"token ids must be 0..{_MAX_TOKEN_ID}") from None
    if packed.itemsize != 4:  # pragma: no cover - no such platform in practice
        return b"".join(_U32.pack(t) for t in tokens)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def _hash_blocks(key: bytes, prev: bytes, block_size: int, token_ids: Sequence[int]) -> list[bytes]:
    width = block_size * 4
    raw = token_bytes(token_ids[: (len(token_ids) // block_size) * block_size])  # whole blocks only
    out: list[bytes] = []
    for start in range(0, len(raw) - width + 1, width):
        prev = _h(key, prev + raw[start : start + width])
        out.append(prev)
    return out


def chain(
    secret: bytes, tenant: str, model: str, cache_salt: str, block_size: int, token_ids: Sequence[int]
) -> list[bytes]:
    """One 16-byte hash per full block of ``token_ids``."""
    start = seed(secret, tenant, model, cache_salt, block_size)
    return _hash_blocks(bytes(secret), start, block_size, token_ids)


def extend(
    secret: bytes,
    tenant: str,
    model: str,
    cache_salt: str,
    block_size: int,
    hashes: Sequence[bytes],
    token_ids: Sequence[int],
) -> list[bytes]:
    """The chain of ``token_ids`` given ``hashes``, the chain of its first ``len(hashes)`` blocks.

    Only the blocks after those are hashed (appending a turn costs only the new
    tokens). ``token_ids`` is the whole sequence, not just the appended part.
    """
    if len(hashes) * block_size > len(token_ids):
        raise ValueError("hashes cover more blocks than token_ids has")
    if not hashes:
        return chain(secret, tenant, model, cache_salt, block_size, token_ids)
    check_secret(secret)
    _check_block_size(block_size)
    prev = bytes(hashes[-1])
    if len(prev) != HASH_BYTES:
        raise ValueError(f"block hashes are {HASH_BYTES} bytes")
    # Only the new blocks' tokens need packing.
    tail = token_ids[len(hashes) * block_size :]
    return [*hashes, *_hash_blocks(bytes(secret), prev, block_size, tail)]


def common_prefix_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading blocks two chains share (binary search: chains are cumulative)."""
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo]; mismatch somewhere at or below hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = [
    "DOMAIN_TAG",
    "HASH_BYTES",
    "MIN_SECRET_BYTES",
    "MAX_SECRET_BYTES",
    "MAX_BLOCK_SIZE",
    "check_secret",
    "seed",
    "chain",
    "extend",
    "common_prefix_blocks",
    "token_bytes",
]


def prefix_digest(token_ids: Sequence[int], num_tokens: int) -> str:
    """Hex SHA-256 digest of the first ``num_tokens`` token ids (definition in the module docstring)."""
    if not 0 < num_tokens <= len(token_ids):
        raise ValueError(f"num_tokens must be 1..{len(token_ids)}, got {num_tokens}")
    head = _lp(PREFIX_DIGEST_TAG) + _U32.pack(num_tokens)
    return hashlib.sha256(head + token_bytes(token_ids[:num_tokens])).hexdigest()
