"""RegistryApp: the registry wired around a given Store (shared by the embedded all-in-one process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health_pb2

from kvbridge.registry.v1 import registry_pb2_grpc
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.metered_store import MeteredStore
from kvbridge_services.common.metrics_http import MetricsEndpoint
from kvbridge_services.common.server import GrpcServer, ServiceBinding
from kvbridge_services.common.store.base import Store
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.store_space import StoreSpaceReadiness
from kvbridge_services.common.telemetry import Telemetry

from .config import RegistrySettings
from .core import Registry
from .feeder import IndexFeeder
from .index import RegistryIndex
from .releaser import BackgroundRevoker, GrpcLeaseReleaser, LeaseReleaser, LogOnlyReleaser
from .service import RegistryServicer

log = logging.getLogger(__name__)

SERVICE_NAME = "kvbridge.registry.v1.RegistryService"


class RegistryApp:
    """Owns the index, its feeder, the revoker and the gRPC server; not the store."""

    def __init__(
        self,
        store: Store,
        *,
        settings: RegistrySettings | None = None,
        server_settings: ServerSettings | None = None,
        keys: KeyLayout | None = None,
        auth: Authenticator | None = None,
        releaser: LeaseReleaser | None = None,
        store_timeout_s: float = 5.0,
        telemetry: Telemetry | None = None,
        peer_tls: PeerTlsSettings | None = None,
        share_port: bool = False,
    ) -> None:
        """``share_port``: bind with SO_REUSEPORT, one of several processes serving the same port (etcd only)."""
        if share_port and isinstance(store, MemoryStore):
            raise ValueError(
                "a registry sharing its port with other processes needs etcd: the embedded store "
                "lives inside one process"
            )
        self.settings = settings or RegistrySettings()
        self.server_settings = server_settings or ServerSettings()
        self.keys = keys or KeyLayout()
        self.store = store
        self.telemetry = telemetry or Telemetry.disabled("kvbridge-registry")
        # Everything below talks to the store through the meter (latency and errors per operation).
        store = MeteredStore(store, self.telemetry.registry)
        self.metrics_endpoint = MetricsEndpoint(
            self.telemetry.registry, self.server_settings.host, self.settings.metrics_port
        )
        self._own_releaser: GrpcLeaseReleaser | None = None
        if releaser is None:
            if self.settings.lease_service_target:
                releaser = self._own_releaser = GrpcLeaseReleaser(
                    self.settings.lease_service_target,
                    api_key=self.settings.lease_service_api_key,
                    timeout_s=self.settings.lease_rpc_timeout_s,
                    tls=peer_tls,
                )
            else:
                releaser = LogOnlyReleaser()
        self.index = RegistryIndex(
            self.settings.max_index_entries,
            self.settings.max_engines,
            self.settings.content_index_stride,
            max_lag_s=self.settings.index_max_lag_s,
        )
        self.revoker = BackgroundRevoker(releaser)
        self.registry = Registry(
            store,
            self.keys,
            self.settings,
            self.index,
            self.revoker,
            store_timeout_s=store_timeout_s,
            group_commit=_group_commit(self.settings, self.store),
        )
        self._sweeper: asyncio.Task[None] | None = None
        max_lag = self.settings.index_max_lag_s
        self.feeder = IndexFeeder(
            store,
            self.keys,
            self.index,
            timeout_s=store_timeout_s,
            progress_interval_s=max_lag / 4,
            restart_after_s=max(5.0, 4 * max_lag),
        )
        self._readiness: asyncio.Task[None] | None = None
        auth = auth or Authenticator({})
        servicer = RegistryServicer(self.registry, auth, store, self.keys, telemetry=self.telemetry)
        self.server = GrpcServer(
            self.server_settings,
            self.settings.port,
            [ServiceBinding(SERVICE_NAME, servicer, registry_pb2_grpc.add_RegistryServiceServicer_to_server)],
            telemetry=self.telemetry,
            reuse_port=share_port,
            auth=auth,
        )
        # Health "kvbridge.store" and kvbridge_store_writes_refused: NOSPACE, while lookups go on.
        self.store_space = StoreSpaceReadiness(
            self.store, self.server.health, self.telemetry.registry, service="registry"
        )

    @property
    def address(self) -> str:
        return str(self.server.address)

    async def start(self) -> None:
        await self.feeder.start()
        self.revoker.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_engines(), name="registry-engine-sweep")
        await self.server.start()
        self._readiness = asyncio.get_running_loop().create_task(self._follow_freshness(), name="registry-readiness")
        await self.store_space.start()
        self.metrics_endpoint.start()

    async def _follow_freshness(self) -> None:
        """Health (readiness) follows the index's freshness: NOT_SERVING while it lags past its bound."""
        serving = True  # what server.start() set
        interval = min(0.25, self.settings.index_max_lag_s / 4)
        while True:
            fresh = self.index.fresh()
            if fresh != serving:
                serving = fresh
                status = health_pb2.HealthCheckResponse.SERVING if fresh else health_pb2.HealthCheckResponse.NOT_SERVING
                log.warning(
                    "registry index %s (lag %.1fs, bound %.1fs): health %s",
                    "fresh again" if fresh else "stale",
                    self.index.lag_s(),
                    self.index.max_lag_s,
                    "SERVING" if fresh else "NOT_SERVING",
                )
                for name in ("", SERVICE_NAME):
                    result = self.server.health.set(name, status)
                    if result is not None:
                        await result
            await asyncio.sleep(interval)

    async def _sweep_engines(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_sweep_interval_s)
            try:
                await self.registry.engines.sweep_engines()
            except Exception:
                log.warning("engine sweep failed", exc_info=True)

    async def stop(self, grace_s: float | None = None) -> None:
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        await self.store_space.stop()
        await self.server.stop(grace_s)
        await self.registry.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.feeder.stop()
        await self.revoker.drain(1.0)
        await self.revoker.stop()
        if self._own_releaser is not None:
            await self._own_releaser.close()
        self.metrics_endpoint.stop()
        await asyncio.to_thread(self.telemetry.force_flush)  # exporting blocks: off the event loop


def _group_commit(settings: RegistrySettings, store: Store) -> bool:
    """Batch registrations where a txn costs a round trip and an fsync (etcd), see docs/adr/0005."""
    if settings.register_batching == "auto":
        return not isinstance(store, MemoryStore)
    return settings.register_batching == "on"
