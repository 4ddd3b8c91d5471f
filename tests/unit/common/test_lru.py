"""The services' bounded LRU map (kvbridge_services.common.lru)."""

from __future__ import annotations

from kvbridge_services.common.lru import SizedLru


def lru(max_bytes: int = 10, max_entries: int = 3) -> SizedLru[bytes]:
    return SizedLru(max_bytes=max_bytes, max_entries=max_entries, nbytes=len)


def test_bytes_bound_evicts_the_least_recently_used_first() -> None:
    cache = lru()
    cache.put("a", b"1234")
    cache.put("b", b"1234")
    assert cache.get("a") == b"1234"  # a read makes "a" recent: "b" goes first
    cache.put("c", b"1234")
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.nbytes == 8 and len(cache) == 2


def test_entries_bound_and_replacement_count_once() -> None:
    cache = lru(max_bytes=100, max_entries=2)
    cache.put("a", b"x" * 10)
    cache.put("a", b"x" * 20)  # replaced, not added
    assert len(cache) == 1 and cache.nbytes == 20
    cache.put("b", b"y")
    cache.put("c", b"z")
    assert len(cache) == 2 and cache.get("a") is None and cache.nbytes == 2


def test_a_value_larger_than_the_bound_is_not_kept_and_drops_the_old_one() -> None:
    cache = lru()
    cache.put("a", b"1")
    cache.put("a", b"x" * 11)
    assert cache.get("a") is None and cache.nbytes == 0
    cache.put("b", b"1")
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
