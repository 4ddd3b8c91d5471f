"""LeaseApp: the lease manager wired together on a given Store.

Built from a Store so the embedded all-in-one process can share one store
between services; the composition root (``__main__``) builds the store itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Sequence

from grpc_health.v1 import health_pb2

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.metered_store import MeteredStore
from kvbridge_services.common.metrics_http import MetricsEndpoint
from kvbridge_services.common.server import GrpcServer, ServiceBinding
from kvbridge_services.common.store.base import Compare, Store
from kvbridge_services.common.store_space import StoreSpaceReadiness
from kvbridge_services.common.telemetry import Telemetry

from .election import LeaderElection
from .manager import LeaseManager
from .metrics import LeaseMetrics
from .persistence import LeasePersistence
from .policy import LeasePolicy
from .service import LeaseServicer
from .table import Clock

log = logging.getLogger(__name__)

SERVICE_NAME = lease_pb2.DESCRIPTOR.services_by_name["LeaseService"].full_name
# gRPC health: "" and SERVICE_NAME are SERVING only on the leader (readiness: Services and load balancers
# route to it); LIVENESS is SERVING while the process runs, leader or standby (liveness probes).
LIVENESS = "liveness"


class LeaseApp:
    """Owns the manager, its election, the gRPC server and /metrics; not the store."""

    def __init__(
        self,
        store: Store,
        policy: LeasePolicy,
        server_settings: ServerSettings,
        *,
        auth: Authenticator | None = None,
        keys: KeyLayout | None = None,
        clock: Clock | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.telemetry = telemetry or Telemetry.disabled("kvbridge-lease")
        # Persistence and election talk to the store through the meter (latency and errors per operation).
        store = MeteredStore(store, self.telemetry.registry)
        self.metrics_endpoint = MetricsEndpoint(self.telemetry.registry, server_settings.host, policy.metrics_port)
        keys = keys or KeyLayout()
        self.servicer_auth = auth or Authenticator({})
        # The election needs the server's address and the persistence needs the election's fence: build the
        # server first (binding the port), then the rest.
        self._election: LeaderElection | None = None
        self.persistence = LeasePersistence(
            store,
            keys,
            self._fence,
            timeout_s=policy.store_timeout_s,
            batch_ops=policy.store_batch_ops,
            attempt_s=policy.store_attempt_timeout_s,
        )
        extra = {"clock": clock} if clock is not None else {}
        self.manager = LeaseManager(
            policy,
            self.persistence,
            leader_hint=self._leader_hint,
            on_fenced=self._fenced,
            metrics=LeaseMetrics(self.telemetry.registry),
            **extra,
        )
        self.servicer = LeaseServicer(self.manager, self.servicer_auth)
        self.server = GrpcServer(
            server_settings,
            policy.port,
            [ServiceBinding(SERVICE_NAME, self.servicer, lease_pb2_grpc.add_LeaseServiceServicer_to_server)],
            telemetry=self.telemetry,
            auth=self.servicer_auth,
        )
        self.election = LeaderElection(
            store,
            keys.leader("lease"),
            policy.advertise_address or self.server.address,
            ttl_s=policy.leader_ttl_s,
            refresh_s=policy.leader_refresh_s,
            timeout_s=policy.store_timeout_s,
            on_elected=self._elected,
            on_deposed=self._deposed,
        )
        self._election = self.election
        self._election_task: asyncio.Task[None] | None = None
        # Health "kvbridge.store" and kvbridge_store_writes_refused: NOSPACE; leadership is not touched by it.
        self.store_space = StoreSpaceReadiness(self.store, self.server.health, self.telemetry.registry, service="lease")

    def _fence(self) -> Sequence[Compare]:
        return list(self._election.fence()) if self._election is not None else []

    def _fenced(self) -> None:
        if self._election is not None:
            self._election.lost()

    def _leader_hint(self) -> str | None:
        return self._election.leader_address if self._election is not None else None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def is_leader(self) -> bool:
        return self.manager.serving

    async def _health(self, names: Sequence[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            result = self.server.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def _elected(self) -> None:
        await self.manager.take_over()
        await self._health(("", SERVICE_NAME), serving=True)

    async def _deposed(self) -> None:
        await self._health(("", SERVICE_NAME), serving=False)
        await self.manager.step_down()

    async def start(self) -> None:
        await self.server.start()
        # A standby until elected (server.start() has just set every name SERVING).
        await self._health(("", SERVICE_NAME), serving=False)
        await self._health((LIVENESS,), serving=True)
        await self.store_space.start()
        self.metrics_endpoint.start()
        self._election_task = asyncio.create_task(self.election.run())

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful: resign first so a standby takes over without waiting for the leader key's TTL."""
        await self.election.resign()
        if self._election_task is not None:
            self._election_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._election_task
        await self.manager.step_down()
        await self.store_space.stop()
        await self.server.stop(grace_s)
        self.metrics_endpoint.stop()
        await asyncio.to_thread(self.telemetry.force_flush)  # exporting blocks: off the event loop
