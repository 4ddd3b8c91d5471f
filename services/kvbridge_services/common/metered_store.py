"""MeteredStore: any Store with latency and error metrics per operation (a decorator, same interface)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from prometheus_client import CollectorRegistry

from .metric_factory import MetricFactory
from .store.base import Store, WatchBatch

P = ParamSpec("P")
T = TypeVar("T")


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricFactory(registry)
        self.seconds = m.histogram(
            "kvbridge_store_request_seconds",
            "Store (etcd) call latency, by operation",
            ["op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.errors = m.counter(
            "kvbridge_store_errors_total", "Store calls that failed, by operation and error type", ["op", "error"]
        )
        self.watch_events = m.counter("kvbridge_store_watch_events_total", "Events received on store watches")


def _timed(
    op: str, method: Callable[Concatenate[Store, P], Awaitable[T]]
) -> Callable[Concatenate[MeteredStore, P], Coroutine[Any, Any, T]]:
    """``method`` of ``inner``, its latency and failures counted under ``op`` (typed as the Store's ``method``)."""
    name = method.__name__

    async def timed(self: MeteredStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        call: Awaitable[T] = getattr(self.inner, name)(*args, **kwargs)
        started = time.perf_counter()
        try:
            return await call
        except Exception as exc:
            self.metrics.errors.labels(op, type(exc).__name__).inc()
            raise
        finally:
            self.metrics.seconds.labels(op).observe(time.perf_counter() - started)

    timed.__name__, timed.__qualname__, timed.__doc__ = name, f"MeteredStore.{name}", method.__doc__
    return timed


def _counted(
    method: Callable[Concatenate[Store, P], AsyncIterator[WatchBatch]],
) -> Callable[Concatenate[MeteredStore, P], AsyncIterator[WatchBatch]]:
    """Watch ``method`` of ``inner``, its events and failures counted."""
    name = method.__name__

    async def counted(self: MeteredStore, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[WatchBatch]:
        stream: AsyncIterator[WatchBatch] = getattr(self.inner, name)(*args, **kwargs)
        try:
            async for batch in stream:
                self.metrics.watch_events.inc(len(batch.events))
                yield batch
        except Exception as exc:
            self.metrics.errors.labels("watch", type(exc).__name__).inc()
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    counted.__name__, counted.__qualname__, counted.__doc__ = name, f"MeteredStore.{name}", method.__doc__
    return counted


class MeteredStore(Store):
    """Wraps ``inner``: every call goes to the same method of ``inner`` (its overrides included), metered under
    its operation's label. Closing it closes ``inner``."""

    def __init__(self, inner: Store, registry: CollectorRegistry | StoreMetrics) -> None:
        self.inner = inner
        self.metrics = registry if isinstance(registry, StoreMetrics) else StoreMetrics(registry)

    get = _timed("get", Store.get)
    range_prefix = _timed("range", Store.range_prefix)
    read_range = _timed("range", Store.read_range)
    put = _timed("put", Store.put)
    delete = _timed("delete", Store.delete)
    txn = _timed("txn", Store.txn)
    apply_txn = _timed("txn", Store.apply_txn)
    grant_lease = _timed("lease_grant", Store.grant_lease)
    refresh_lease = _timed("lease_refresh", Store.refresh_lease)
    revoke_lease = _timed("lease_revoke", Store.revoke_lease)
    lease_ttl = _timed("lease_ttl", Store.lease_ttl)
    current_revision = _timed("revision", Store.current_revision)
    watch_prefix = _counted(Store.watch_prefix)
    watch = _counted(Store.watch)

    def writes_refused(self) -> str | None:
        return self.inner.writes_refused()

    async def close(self) -> None:
        await self.inner.close()
