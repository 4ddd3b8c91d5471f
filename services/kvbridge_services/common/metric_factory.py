"""MetricFactory: declares Prometheus metrics in one registry (every service keeps its own, so several can live in
one process), one line each."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

_PREFIX = "kvbridge_"
# No ``*_created`` series (one per counter and histogram child, holding its creation time): they double the
# series a scrape stores and dashboards never read them. Process-wide, before any metric is made: every kvbridge
# service makes its metrics through this module or after importing it (telemetry.py).
disable_created_metrics()  # type: ignore[no-untyped-call]


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
