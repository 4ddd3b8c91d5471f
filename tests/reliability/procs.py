"""Services as real processes for fault tests: start on a fixed port, kill -9, restart on the same port."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.fixtures.common import free_port
from tests.fixtures.control_plane_procs import _spawn, _stop, _wait_for_grpc


def service_env(etcd_endpoints: str, **extra: str) -> dict[str, str]:
    """Environment of a service on etcd, loopback only, no API keys, no /metrics port."""
    env = {
        **os.environ,
        "KVBRIDGE_ETCD_ENDPOINTS": etcd_endpoints,
        "KVBRIDGE_HOST": "127.0.0.1",
        "KVBRIDGE_REGISTRY_METRICS_PORT": "0",
        "KVBRIDGE_LEASE_METRICS_PORT": "0",
        **extra,
    }
    env.pop("KVBRIDGE_API_KEYS_FILE", None)
    return env


class ServiceProcess:
    """``python -m <module>`` listening on ``port`` (picked now, kept across restarts)."""

    def __init__(
        self, module: str, env: dict[str, str], log_dir: Path, *, port_var: str, port: int | None = None, name: str = ""
    ) -> None:
        self.module = module
        self.port = port or free_port()
        self.env = {**env, port_var: str(self.port)}
        self.log_dir = log_dir
        self.name = name or module.rsplit(".", 1)[-1]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def start(self, wait: bool = True) -> None:
        self.starts += 1
        self.proc = _spawn(self.module, self.env, self.log)
        if wait:
            _wait_for_grpc(self.target, self.proc, self.log, timeout_s=60)

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)


def registry_process(etcd_endpoints: str, lease_target: str, log_dir: Path) -> ServiceProcess:
    env = service_env(etcd_endpoints, KVBRIDGE_REGISTRY_LEASE_SERVICE_TARGET=lease_target)
    return ServiceProcess("kvbridge_services.registry", env, log_dir, port_var="KVBRIDGE_REGISTRY_PORT")


def lease_process(
    etcd_endpoints: str, log_dir: Path, *, port: int | None = None, name: str = "lease", **extra: str
) -> ServiceProcess:
    return ServiceProcess(
        "kvbridge_services.lease",
        service_env(etcd_endpoints, **extra),
        log_dir,
        port_var="KVBRIDGE_LEASE_PORT",
        port=port,
        name=name,
    )
