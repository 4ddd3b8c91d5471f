"""Keyless threads (threads.py): which thread a keyless prompt continues, forks or starts."""

from __future__ import annotations

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.gateway.chaincache import ChainCache, Scope
from kvbridge_services.gateway.threads import (
    TAIL_SLACK_BLOCKS,
    THREAD_KEY_PREFIX,
    RecentThreads,
    ThreadWhy,
    continued_by_lookup,
    is_thread_key,
)

SECRET = bytes(range(32))
B = 16
SCOPE = Scope("acme", "m", "", B)


def _served(threads: RecentThreads, chains: ChainCache, ids: list[int], key: str, scope: Scope = SCOPE) -> None:
    chains.chain(scope, key, ids)
    threads.served(scope, ids, key)


def test_a_prompt_that_extends_a_threads_last_prompt_continues_it() -> None:
    chains = ChainCache(SECRET, max_bytes=1 << 20)
    threads = RecentThreads(chains)
    first = list(range(100))
    _served(threads, chains, first, THREAD_KEY_PREFIX + "t1")
    found = threads.find(SCOPE, [*first, 7, 8, 9, *range(500, 540)])
    assert (found.key, found.why, found.base) == (
        THREAD_KEY_PREFIX + "t1",
        ThreadWhy.CONTINUES,
        THREAD_KEY_PREFIX + "t1",
    )
    assert found.continues


def test_a_prompt_that_diverges_inside_a_threads_last_prompt_forks_it() -> None:
    chains = ChainCache(SECRET, max_bytes=1 << 20)
    threads = RecentThreads(chains)
    first = list(range(100))
    _served(threads, chains, first, THREAD_KEY_PREFIX + "t1")
    edited = [*first[:40], 9999, *first[41:]]  # an edit in block 2: blocks 0 and 1 are shared
    found = threads.find(SCOPE, edited)
    assert found.why is ThreadWhy.FORKS and found.base == THREAD_KEY_PREFIX + "t1"
    assert is_thread_key(found.key) and found.key != THREAD_KEY_PREFIX + "t1"
    assert chains.shared_blocks(SCOPE, found.base, hashchain.token_bytes(edited[: len(edited) // B * B])) == 2


def test_nothing_shared_or_another_scope_is_a_new_thread() -> None:
    chains = ChainCache(SECRET, max_bytes=1 << 20)
    threads = RecentThreads(chains)
    _served(threads, chains, list(range(100)), THREAD_KEY_PREFIX + "t1")
    assert threads.find(SCOPE, list(range(1000, 1100))).why is ThreadWhy.NEW
    for other in (Scope("globex", "m", "", B), Scope("acme", "m", "salt", B), Scope("acme", "other", "", B)):
        assert threads.find(other, list(range(100))).why is ThreadWhy.NEW  # tenants, salts, models never meet
    assert threads.find(SCOPE, list(range(10))).why is ThreadWhy.NEW  # shorter than a block: nothing to find


def test_of_two_threads_behind_one_first_block_the_longer_match_wins() -> None:
    chains = ChainCache(SECRET, max_bytes=1 << 20)
    threads = RecentThreads(chains)
    system = list(range(64))  # a shared system prompt: both threads have the same first block
    a, b = [*system, *range(100, 164)], [*system, *range(200, 264)]
    _served(threads, chains, a, THREAD_KEY_PREFIX + "a")
    _served(threads, chains, b, THREAD_KEY_PREFIX + "b")
    assert threads.find(SCOPE, [*a, 1, 2, 3]).key == THREAD_KEY_PREFIX + "a"
    assert threads.find(SCOPE, [*b, 1, 2, 3]).key == THREAD_KEY_PREFIX + "b"


def test_recent_threads_are_bounded_per_first_block_and_in_all() -> None:
    chains = ChainCache(SECRET, max_bytes=1 << 22)
    threads = RecentThreads(chains, max_threads=10, per_first_block=3)
    system = list(range(16))
    for i in range(5):
        _served(threads, chains, [*system, *range(1000 * i, 1000 * i + 32)], f"{THREAD_KEY_PREFIX}{i}")
    assert len(threads) == 3  # the oldest two behind the shared first block were dropped
    assert threads.find(SCOPE, [*system, *range(0, 32), 5]).why is ThreadWhy.FORKS  # thread 0 forgotten
    for i in range(20):
        _served(threads, chains, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 32)), f"{THREAD_KEY_PREFIX}x{i}")
    assert len(threads) <= 10


def _answer(key: str, verified: int, entry_tokens: int) -> registry_pb2.LookupEntryResponse:
    found = registry_pb2.LookupEntryResponse(verdict=registry_pb2.LOOKUP_VERDICT_HIT, verified_tokens=verified)
    found.location.conversation_key = key
    found.location.entry_token_count = entry_tokens
    found.location.epoch = 5
    return found


def test_a_content_hit_continues_a_thread_verified_to_within_its_tail() -> None:
    key = THREAD_KEY_PREFIX + "t"
    slack = TAIL_SLACK_BLOCKS * B
    assert continued_by_lookup(_answer(key, 320, 320 + slack), B) == key
    assert continued_by_lookup(_answer(key, 320, 320 + slack + 1), B) is None  # diverged earlier: a fork
    assert continued_by_lookup(_answer("keyed-conversation", 320, 320), B) is None  # never take over a keyed one
    assert continued_by_lookup(registry_pb2.LookupEntryResponse(), B) is None
