"""``kvbridge up`` serves the registry's and the lease manager's /metrics beside the gateway's (issue 31), each
with process_* and without *_created series."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvbridge_services.stack import LEASE_METRICS_PORT, REGISTRY_METRICS_PORT, metrics_port
from tests.fixtures.cli_proc import wait_for_output
from tests.fixtures.common import free_port

REPO = Path(__file__).resolve().parents[3]


def test_the_stacks_metrics_ports_follow_the_standalone_services() -> None:
    assert (REGISTRY_METRICS_PORT, LEASE_METRICS_PORT) == (9151, 9152)
    assert metrics_port(None, 50051, REGISTRY_METRICS_PORT) == 9151  # kvbridge up on its fixed ports
    assert metrics_port(None, 0, REGISTRY_METRICS_PORT) == 0  # an ephemeral stack: off
    assert metrics_port(19151, 0, REGISTRY_METRICS_PORT) == 19151
    assert metrics_port(0, 50051, REGISTRY_METRICS_PORT) == 0


def _families(url: str) -> set[str]:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    names = {s.name for f in text_string_to_metric_families(r.text) for s in f.samples}
    assert not [n for n in names if n.endswith("_created")], names
    return names


def test_kvbridge_up_serves_registry_and_lease_metrics(tmp_path: Path) -> None:
    http_port, registry_metrics, lease_metrics = free_port(), free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")},
        "KVBRIDGE_REGISTRY_METRICS_PORT": str(registry_metrics),
        "KVBRIDGE_LEASE_METRICS_PORT": str(lease_metrics),
    }
    ports = ["--registry-port", "0", "--lease-port", "0", "--gateway-http-port", str(http_port)]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_services.cli", "up", *ports, "--gateway-grpc-port", "0"],
            stdout=stdout,
            stderr=stderr,
            cwd=REPO,
            env=env,
        )
    try:
        wait_for_output(err, "stack is up", proc, 120)
        printed = dict(re.findall(r"\] (registry|lease manager) metrics: (\S+)$", err.read_text(), re.MULTILINE))
        assert printed == {
            "registry": f"http://127.0.0.1:{registry_metrics}/metrics",
            "lease manager": f"http://127.0.0.1:{lease_metrics}/metrics",
        }
        registry = _families(printed["registry"])
        lease = _families(printed["lease manager"])
        gateway = _families(f"http://127.0.0.1:{http_port}/metrics")
        assert {"kvbridge_registry_entries", "kvbridge_store_request_seconds_count"} <= registry
        assert {"kvbridge_lease_is_leader", "kvbridge_lease_live_leases"} <= lease
        assert "kvbridge_gateway_requests_total" in gateway or "kvbridge_gateway_inflight_requests" in gateway
        for names in (registry, lease, gateway):
            assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"} <= names
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
