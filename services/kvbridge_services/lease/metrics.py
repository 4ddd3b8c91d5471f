"""Prometheus metrics of the lease manager (``kvbridge_lease_*``), in the service's registry.

Grants and ends are counted as they happen. Renewals (the hot path: hundreds of thousands a
second) and the live state (leases by kind, watch subscribers, leadership) are read from the
manager when ``/metrics`` is scraped, so a renewal takes no metric lock. The scrape runs on the
endpoint's thread: it reads only ints and single dict entries, which the GIL keeps consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvbridge.lease.v1 import lease_pb2
from kvbridge.types.v1 import types_pb2

from .table import Ended

_KINDS: dict[int, str] = {lease_pb2.LEASE_KIND_ENTRY: "ENTRY", lease_pb2.LEASE_KIND_NODE: "NODE"}
_REASON_PREFIX = "REVOKE_REASON_"


def kind_label(kind: int) -> str:
    return _KINDS.get(kind, "UNSPECIFIED")


def reason_label(reason: int) -> str:
    """``EXPIRED`` for REVOKE_REASON_EXPIRED; an unknown number as itself."""
    if reason in types_pb2.RevokeReason.values():
        return types_pb2.RevokeReason.Name(reason).removeprefix(_REASON_PREFIX)  # type: ignore[arg-type]
    return str(reason)


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What the manager exposes to a scrape (the callables are read on the endpoint's thread)."""

    renewals: Callable[[], int]
    live_by_kind: Callable[[], Mapping[int, int]]
    watch_subscribers: Callable[[], int]
    is_leader: Callable[[], bool]


class _StateCollector(Collector):
    def __init__(self, owner: LeaseMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._owner.state)

    @staticmethod
    def _families(state: LeaseState | None) -> list[Metric]:
        renewals = CounterMetricFamily("kvbridge_lease_renewals", "Lease renewals accepted by this replica")
        live = GaugeMetricFamily(
            "kvbridge_lease_live_leases", "Live leases held by this replica, by kind", labels=["kind"]
        )
        watchers = GaugeMetricFamily("kvbridge_lease_watch_subscribers", "Open WatchLeases subscribers")
        leader = GaugeMetricFamily("kvbridge_lease_is_leader", "1 while this replica is the serving leader")
        if state is not None:
            renewals.add_metric([], state.renewals())
            by_kind = state.live_by_kind()
            for kind, name in _KINDS.items():
                live.add_metric([name], by_kind.get(kind, 0))
            watchers.add_metric([], state.watch_subscribers())
            leader.add_metric([], 1.0 if state.is_leader() else 0.0)
        return [renewals, live, watchers, leader]


class LeaseMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.grants = Counter("kvbridge_lease_grants", "Leases granted, by kind", ["kind"], registry=registry)
        self.ended = Counter(
            "kvbridge_lease_ended", "Leases ended, by reason (EXPIRED, SUPERSEDED, ...)", ["reason"], registry=registry
        )
        for name in _KINDS.values():
            self.grants.labels(name)
        for reason in types_pb2.RevokeReason.values():
            if reason:
                self.ended.labels(reason_label(reason))
        self.state: LeaseState | None = None
        registry.register(_StateCollector(self))

    def bind(self, state: LeaseState) -> None:
        """Called by the manager that owns this object (one manager per registry)."""
        self.state = state

    def granted(self, kind: int) -> None:
        self.grants.labels(kind_label(kind)).inc()

    def count_ended(self, ended: Iterable[Ended]) -> None:
        for item in ended:
            self.ended.labels(reason_label(item.reason)).inc()
