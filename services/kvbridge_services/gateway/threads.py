"""Keyless threads (ADR 0022): reuse for a client that sends its whole history and no conversation key.

Such a turn is given a *thread key*: the key it registers its new KV under (D's connector, or this gateway in
compatibility mode) and looks it up by next turn. A conversation key stays a hint; without one the thread is
found by content:

- **On this gateway** (``RecentThreads``): the keyless threads it served lately, found by their first block's
  token ids and checked by a memcmp of the whole prompt against the ids the chain cache hashed for the thread. A
  prompt that contains every full block of a thread's last prompt **continues** it: it takes the thread's key
  (a keyed lookup, from the entry mirror, waiting for the previous turn's registration like a keyed turn) and
  its registration supersedes the thread's previous entry. A prompt that shares only part of it **forks**: a
  new key, so both continuations keep their KV (within the registry's per-tenant caps and the leases' TTLs).
- **Anywhere else** (another gateway replica served the last turn, or this one forgot it): a content lookup in
  the registry finds the tenant's longest verified prefix; if that is a thread's entry verified to within
  ``TAIL_SLACK_BLOCKS`` of its end (the previous answer, re-rendered by the chat template, may differ in its
  last tokens), the turn continues that thread.

Whatever the thread, what P may reuse is decided exactly as for a keyed turn: the verified prefix of the
prompt's keyed block-hash chain within (tenant, model, cache_salt); the thread key only names where to look
and what to supersede, never what to trust.
"""

from __future__ import annotations

import enum
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2

from .chaincache import ChainCache, Scope

# Thread keys are conversation keys the gateway makes (printable ASCII, within the key rule's 256 characters).
THREAD_KEY_PREFIX = "~kvb-thread:"
# A thread's entry verified to within this many blocks of its end is continued, not forked (the answer's last
# tokens, as generated, may differ from the same answer re-rendered into the next prompt).
TAIL_SLACK_BLOCKS = 2


class ThreadWhy(enum.Enum):
    CONTINUES = "continues"  # the prompt extends the thread's last prompt: same key, next epoch
    FORKS = "forks"  # the prompt shares part of a thread's history: a new key, both kept
    NEW = "new"  # nothing of this gateway's recent threads: a new key (a content lookup may still continue one)


@dataclass(frozen=True, slots=True)
class Thread:
    key: str
    why: ThreadWhy
    # The thread whose hashed ids this prompt shares (the chain cache hashes only the blocks after them).
    base: str = ""

    @property
    def continues(self) -> bool:
        return self.why is ThreadWhy.CONTINUES


def new_thread_key() -> str:
    """A fresh key: random, so that two forks of one history (or two tenants' identical first turns, which the
    tenant scope keeps apart anyway) never share one."""
    return THREAD_KEY_PREFIX + secrets.token_hex(12)


def is_thread_key(key: str) -> bool:
    return key.startswith(THREAD_KEY_PREFIX)


def continued_by_lookup(found: registry_pb2.LookupEntryResponse, block_size: int) -> str | None:
    """The thread a content lookup's answer continues (its key), or None: the answer names a thread's entry and
    verifies all of it but at most ``TAIL_SLACK_BLOCKS`` blocks at its end."""
    if not found.HasField("location"):
        return None
    loc = found.location
    if not is_thread_key(loc.conversation_key) or not loc.entry_token_count:
        return None
    if found.verified_tokens + TAIL_SLACK_BLOCKS * block_size < loc.entry_token_count:
        return None
    return loc.conversation_key


@dataclass(slots=True)
class _Seen:
    prompt_blocks: int  # full blocks of the thread's last prompt


class RecentThreads:
    """The keyless threads this gateway served lately, per scope, bounded (least recently used go).

    Found by the packed ids of a prompt's first block (a dict probe), then each candidate checked against the
    ids the chain cache holds for it (a memcmp, no hashing): ``per_first_block`` candidates at most, so that many
    conversations behind one system prompt cost a bounded number of comparisons.
    """

    def __init__(self, chains: ChainCache, *, max_threads: int = 100_000, per_first_block: int = 16) -> None:
        self._chains = chains
        self._max_threads = max_threads
        self._per_first_block = per_first_block
        self._by_first_block: OrderedDict[tuple[Scope, bytes], OrderedDict[str, _Seen]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def find(self, scope: Scope, token_ids: Sequence[int]) -> Thread:
        """The thread ``token_ids`` continues or forks, or a new one."""
        first = _first_block(scope, token_ids)
        candidates = self._by_first_block.get((scope, first)) if first is not None else None
        if not candidates:
            return Thread(new_thread_key(), ThreadWhy.NEW)
        best_key, best_blocks, best_seen = "", -1, None
        b = scope.block_size
        packed = hashchain.token_bytes(token_ids[: len(token_ids) // b * b])  # once for every candidate
        for key, seen in reversed(candidates.items()):  # the most recent first: it wins a tie
            shared = self._chains.shared_blocks(scope, key, packed)
            if shared > best_blocks:
                best_key, best_blocks, best_seen = key, shared, seen
        assert best_seen is not None
        if best_blocks >= best_seen.prompt_blocks > 0:
            return Thread(best_key, ThreadWhy.CONTINUES, base=best_key)
        if best_blocks > 0:
            return Thread(new_thread_key(), ThreadWhy.FORKS, base=best_key)
        return Thread(new_thread_key(), ThreadWhy.NEW)

    def served(self, scope: Scope, token_ids: Sequence[int], key: str) -> None:
        """Records that thread ``key``'s last prompt was ``token_ids`` (call after its ids were hashed under key)."""
        first = _first_block(scope, token_ids)
        if first is None:
            return
        slot = (scope, first)
        candidates = self._by_first_block.get(slot)
        if candidates is None:
            candidates = self._by_first_block[slot] = OrderedDict()
        else:
            self._by_first_block.move_to_end(slot)
        if key in candidates:
            candidates.move_to_end(key)
        else:
            self._count += 1
            if len(candidates) >= self._per_first_block:
                candidates.popitem(last=False)
                self._count -= 1
        candidates[key] = _Seen(prompt_blocks=len(token_ids) // scope.block_size)
        while self._count > self._max_threads and self._by_first_block:
            _, oldest = self._by_first_block.popitem(last=False)
            self._count -= len(oldest)


def _first_block(scope: Scope, token_ids: Sequence[int]) -> bytes | None:
    if len(token_ids) < scope.block_size:
        return None
    return hashchain.token_bytes(token_ids[: scope.block_size])
