"""What a service says while its store refuses writes (etcd's NOSPACE alarm): a gRPC health name and a gauge.

The service keeps serving meanwhile (reads answer, turns fail open to recompute), so its readiness (``""`` and its
service name) stays as it was: turning it off on every replica at once would take the reads away too. Instead the
health name ``kvbridge.store`` is NOT_SERVING and ``kvbridge_store_writes_refused`` is 1 while writes are refused
(the reason is logged once per episode by the store); both come back without a restart once the store takes writes
again. See docs/etcd-space.md.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from .metric_factory import MetricFactory
from .store.base import Store

log = logging.getLogger(__name__)

STORE_HEALTH = "kvbridge.store"
_INTERVAL_S = 0.25


class StoreSpaceReadiness:
    """Follows ``store.writes_refused()`` into the health name ``kvbridge.store`` and the gauge."""

    def __init__(self, store: Store, health: Any, registry: CollectorRegistry, *, service: str) -> None:
        self._store = store
        self._health = health
        self._service = service
        gauge = MetricFactory(registry).gauge(
            "kvbridge_store_writes_refused",
            "1 while the store refuses writes for lack of space (etcd's NOSPACE alarm): registrations and lease "
            "grants fail with STORE_NO_SPACE, reads and turns go on",
        )
        gauge.set_function(lambda: 0.0 if store.writes_refused() is None else 1.0)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Sets the health name now (a health List right after start names it), then follows the store."""
        serving = self._store.writes_refused() is None
        await self._set(serving)
        self._task = asyncio.get_running_loop().create_task(self._follow(serving), name=f"{self._service}-store-space")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        result = self._health.set(STORE_HEALTH, status)
        if inspect.isawaitable(result):
            await result

    async def _follow(self, shown: bool) -> None:
        """``shown``: what the health name says (SERVING: True)."""
        while True:
            why = self._store.writes_refused()
            if (why is None) != shown:
                shown = why is None
                await self._set(shown)
                if shown:
                    log.info("%s: health %r SERVING (the store takes writes)", self._service, STORE_HEALTH)
                else:
                    log.warning(
                        "%s: health %r NOT_SERVING (%s); %r itself stays as it was: reads answer, turns fail open",
                        self._service,
                        STORE_HEALTH,
                        why,
                        "",
                    )
            await asyncio.sleep(_INTERVAL_S)
