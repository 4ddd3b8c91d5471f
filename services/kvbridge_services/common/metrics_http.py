"""A service's Prometheus ``/metrics`` on its own HTTP port (gRPC services have no HTTP server of their own)."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves ``registry`` at ``http://host:port/metrics`` from a daemon thread; port 0 means off."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._host = host
        self._requested_port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._requested_port != 0

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}/metrics" if self._server is not None else ""

    def start(self) -> None:
        if not self.enabled or self._server is not None:
            return
        self._server, self._thread = start_http_server(self._requested_port, addr=self._host, registry=self._registry)
        log.info("metrics on %s", self.url)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None
