"""MetricFactory: declares Prometheus metrics in one registry (every service keeps its own, so several can live in
one process), one line each."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFIX = "kvbridge_"


class MetricFactory:
    """Metrics named ``kvbridge_<component>_...`` (the full name is written out, so it can be searched for),
    registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    @staticmethod
    def _checked(name: str) -> str:
        if not name.startswith(_PREFIX):
            raise ValueError(f"metric {name!r}: kvbridge metric names start with {_PREFIX!r}")
        return name

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._checked(name), documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self._checked(name), documentation, labels, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(self._checked(name), documentation, labels, registry=self.registry, buckets=buckets)
