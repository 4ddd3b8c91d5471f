"""One bounded LRU map for the services' per-conversation caches (the gateway's prompt encodings and hash
chains): cachetools' LRUCache bounded by the bytes its values hold, plus a cap on entries."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

V = TypeVar("V")


class SizedLru(Generic[V]):
    """Least recently stored (or read) entries go first once the values' bytes pass ``max_bytes`` or the
    entries pass ``max_entries``; a value larger than ``max_bytes`` alone is not kept."""

    def __init__(self, *, max_bytes: int, max_entries: int, nbytes: Callable[[V], int]) -> None:
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._nbytes = nbytes
        self._cache: LRUCache[Hashable, V] = LRUCache(maxsize=max(max_bytes, 1), getsizeof=nbytes)

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def nbytes(self) -> int:
        return int(self._cache.currsize)

    def get(self, key: Hashable) -> V | None:
        return self._cache.get(key)

    def put(self, key: Hashable, value: V) -> None:
        """Keeps ``value`` as the entry of ``key`` (replacing the old one), then evicts down to the bounds."""
        self._cache.pop(key, None)
        if self._nbytes(value) > self._max_bytes:
            return
        self._cache[key] = value  # evicts by bytes
        while len(self._cache) > self._max_entries:
            self._cache.popitem()

    def clear(self) -> None:
        self._cache.clear()
