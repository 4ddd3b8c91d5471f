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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the e2e tests last: their vLLM engines are shared for the rest of the session and
    spin both cores of this machine, which would starve every timing-bounded test after them."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)
