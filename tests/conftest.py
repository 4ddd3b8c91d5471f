"""Shared pytest fixtures: real etcd servers and clusters.

Without an etcd binary the etcd fixtures FAIL (tests/fixtures/common.py: a missing part fails its
tests, never skips them), so no run missing etcd can pass silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.common import require_etcd_binary
from tests.fixtures.etcd import EtcdCluster, EtcdServer, start_cluster, start_server

# Service processes spawned by tests must not fight over the fixed production
# metrics ports (9151/9152): tests that want /metrics pick free ports themselves.
for _var in ("KVBRIDGE_REGISTRY_METRICS_PORT", "KVBRIDGE_LEASE_METRICS_PORT"):
    os.environ.setdefault(_var, "0")


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh single-member etcd; ``.endpoint`` is "127.0.0.1:<port>"."""
    server = start_server(tmp_path / "etcd", binary=require_etcd_binary())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on loopback."""
    cluster = start_cluster(tmp_path / "etcd-cluster", binary=require_etcd_binary())
    try:
        yield cluster
    finally:
        cluster.close()


# The e2e engine pool keeps one P/D pair per configuration (tests/e2e/conftest.py): tests of one configuration
# run together so each pair starts once. Tests that start engines of their own (kvbridge up, the demo) first.
_ENGINE_CONFIGURATIONS = ("pd_engines", "kvbridge_pd", "traced_pd", "small_cache_pd")


def _engine_group(item: pytest.Item) -> int:
    names = getattr(item, "fixturenames", ())
    return next((i + 1 for i, name in enumerate(_ENGINE_CONFIGURATIONS) if name in names), 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the e2e tests last: their vLLM engines are shared for the rest of the session and
    spin both cores of this machine, which would starve every timing-bounded test after them."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("e2e") is not None,
            _engine_group(item) if item.get_closest_marker("e2e") else 0,
        )
    )
