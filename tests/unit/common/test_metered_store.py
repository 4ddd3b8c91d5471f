"""MeteredStore forwards every Store call to the same method of the store it wraps, metered under the operation's
label; the Store's keyword forms build its request objects; MetricFactory keeps the kvbridge_ naming rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvbridge_services.common.metered_store import MeteredStore
from kvbridge_services.common.metric_factory import MetricFactory
from kvbridge_services.common.store import Compare, Op, Put, RangeQuery, Txn, TxnResult, WatchQuery
from kvbridge_services.common.store.memory import MemoryStore


class TxnCounting(MemoryStore):
    """Overrides the keyword form, as test doubles do: the meter must still reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.txns = 0

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (), *, timeout: float = 5.0
    ) -> TxnResult:
        self.txns += 1
        return await super().txn(compares, success, failure, timeout=timeout)


def count(registry: CollectorRegistry, op: str) -> Any:
    return registry.get_sample_value("kvbridge_store_request_seconds_count", {"op": op})


async def test_every_operation_is_forwarded_and_metered_under_its_label() -> None:
    registry = CollectorRegistry()
    inner = TxnCounting()
    store = MeteredStore(inner, registry)
    lease = await store.grant_lease(10)
    await store.put(b"/m/a", b"1", lease=lease)
    before = inner.txns
    await store.txn((Compare.absent(b"/m/b"),), (Put(b"/m/b", b"2"),))
    await store.apply_txn(Txn((), (Put(b"/m/c", b"3"),)))
    assert inner.txns == before + 1  # the keyword call reached the override; apply_txn went to the backend's
    kvs, revision = await store.range_prefix(b"/m/", limit=2)
    assert [kv.key for kv in kvs] == [b"/m/a", b"/m/b"]
    assert (await store.read_range(RangeQuery(b"/m/", start_after=b"/m/b")))[0][0].key == b"/m/c"
    assert await store.current_revision() == revision
    assert await store.refresh_lease(lease) == 10
    assert 0 < await store.lease_ttl(lease) <= 10
    await store.revoke_lease(lease)
    assert await store.get(b"/m/a") is None
    assert await store.delete(b"/m/", prefix=True) == 2

    expected = {"lease_grant": 1, "put": 1, "txn": 2, "range": 2, "revision": 1, "lease_refresh": 1}
    expected |= {"lease_ttl": 1, "lease_revoke": 1, "get": 1, "delete": 1}
    assert {op: count(registry, op) for op in expected} == expected
    assert MeteredStore.get.__name__ == "get" and MeteredStore.txn.__doc__ == MemoryStore.txn.__doc__
    await store.close()


async def test_watches_count_events_and_failures() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(MemoryStore(), registry)
    first = await store.put(b"/w/a", b"1")
    await store.put(b"/w/b", b"2")
    keyword = store.watch_prefix(b"/w/", start_revision=first)
    assert len((await anext(keyword)).events) == 2
    await keyword.aclose()  # type: ignore[attr-defined]
    query = store.watch(WatchQuery(b"/w/", start_revision=first))
    assert len((await anext(query)).events) == 2
    await query.aclose()  # type: ignore[attr-defined]
    assert registry.get_sample_value("kvbridge_store_watch_events_total") == 4

    await store.close()
    with pytest.raises(Exception, match="store is closed"):
        await anext(store.watch_prefix(b"/w/"))
    assert registry.get_sample_value("kvbridge_store_errors_total", {"op": "watch", "error": "StoreUnavailable"}) == 1


async def test_request_objects_refuse_negative_bounds() -> None:
    with pytest.raises(ValueError, match="limit must be >= 0"):
        RangeQuery(b"/", limit=-1)
    with pytest.raises(ValueError, match="start_revision must be >= 0"):
        WatchQuery(b"/", start_revision=-1)
    store = MemoryStore()
    with pytest.raises(ValueError, match="limit must be >= 0"):
        await store.range_prefix(b"/", limit=-1)
    await store.close()


def test_metric_names_keep_the_kvbridge_prefix() -> None:
    metrics = MetricFactory(CollectorRegistry())
    assert metrics.counter("kvbridge_test_things_total", "Things", ["kind"])._labelnames == ("kind",)
    with pytest.raises(ValueError, match="start with 'kvbridge_'"):
        metrics.gauge("test_things", "Things")
