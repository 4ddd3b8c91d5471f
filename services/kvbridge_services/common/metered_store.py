"""MeteredStore: any Store with latency and error metrics per operation (a decorator, same interface)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from .store.base import DEFAULT_TIMEOUT_S, Compare, KeyValue, Op, Store, TxnResult, WatchBatch

T = TypeVar("T")


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "kvbridge_store_request_seconds",
            "Store (etcd) call latency, by operation",
            ["op"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.errors = Counter(
            "kvbridge_store_errors_total",
            "Store calls that failed, by operation and error type",
            ["op", "error"],
            registry=registry,
        )
        self.watch_events = Counter(
            "kvbridge_store_watch_events_total", "Events received on store watches", registry=registry
        )


class MeteredStore(Store):
    """Wraps ``inner``; closing it closes ``inner``."""

    def __init__(self, inner: Store, registry: CollectorRegistry | StoreMetrics) -> None:
        self.inner = inner
        self.metrics = registry if isinstance(registry, StoreMetrics) else StoreMetrics(registry)

    async def _timed(self, op: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await call
        except Exception as exc:
            self.metrics.errors.labels(op, type(exc).__name__).inc()
            raise
        finally:
            self.metrics.seconds.labels(op).observe(time.perf_counter() - started)

    async def get(self, key: bytes, *, timeout: float = DEFAULT_TIMEOUT_S) -> KeyValue | None:
        return await self._timed("get", self.inner.get(key, timeout=timeout))

    async def range_prefix(
        self,
        prefix: bytes,
        *,
        start_after: bytes | None = None,
        limit: int = 0,
        keys_only: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> tuple[list[KeyValue], int]:
        return await self._timed(
            "range",
            self.inner.range_prefix(prefix, start_after=start_after, limit=limit, keys_only=keys_only, timeout=timeout),
        )

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("put", self.inner.put(key, value, lease=lease, timeout=timeout))

    async def delete(self, key: bytes, *, prefix: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("delete", self.inner.delete(key, prefix=prefix, timeout=timeout))

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> TxnResult:
        return await self._timed("txn", self.inner.txn(compares, success, failure, timeout=timeout))

    async def grant_lease(self, ttl_s: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("lease_grant", self.inner.grant_lease(ttl_s, timeout=timeout))

    async def refresh_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("lease_refresh", self.inner.refresh_lease(lease_id, timeout=timeout))

    async def revoke_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await self._timed("lease_revoke", self.inner.revoke_lease(lease_id, timeout=timeout))

    async def lease_ttl(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("lease_ttl", self.inner.lease_ttl(lease_id, timeout=timeout))

    async def watch_prefix(
        self, prefix: bytes, *, start_revision: int = 0, progress_interval_s: float = 0.0
    ) -> AsyncIterator[WatchBatch]:
        stream = self.inner.watch_prefix(prefix, start_revision=start_revision, progress_interval_s=progress_interval_s)
        try:
            async for batch in stream:
                self.metrics.watch_events.inc(len(batch.events))
                yield batch
        except Exception as exc:
            self.metrics.errors.labels("watch", type(exc).__name__).inc()
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def current_revision(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return await self._timed("revision", self.inner.current_revision(timeout=timeout))

    async def close(self) -> None:
        await self.inner.close()
