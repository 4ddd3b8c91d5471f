"""Builds a gRPC aio server the same way for every service.

Health checking (Check, Watch, List) and reflection (v1 and v1alpha) on every server
(kvbridge_services.common.introspection), a tracing + RPC-metrics
interceptor (kvbridge_services.common.telemetry), optional TLS / mutual TLS, message-size caps, bounds on
concurrent RPCs per principal class (kvbridge_services.common.limits, enforced by the authorization interceptor:
tenants never take the share kept for engines and services), connection age / idle limits and keepalive, and
graceful shutdown: health flips to NOT_SERVING, then in-flight RPCs drain for the grace period, then the server
stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .auth import Authenticator
from .authz import AuthzInterceptor
from .config import ServerSettings, check_bind
from .decode_guard import DecodeGuardInterceptor
from .introspection import HEALTH, ListingHealthServicer, enable_reflection
from .limits import RpcLimiter
from .telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """A servicer and the generated function that adds it to a server."""

    full_name: str  # e.g. "kvbridge.registry.v1.RegistryService"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings' PEM files; None for plaintext. A client CA makes it mutual TLS."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    pair = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
    client_ca = settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


class GrpcServer:
    def __init__(
        self,
        settings: ServerSettings,
        port: int,
        bindings: Sequence[ServiceBinding],
        *,
        telemetry: Telemetry | None = None,
        reuse_port: bool = False,
        auth: Authenticator | None = None,
    ) -> None:
        self._settings = settings
        if auth is not None:  # secure by default: no keys, loopback only (KVBRIDGE_INSECURE=1 overrides)
            check_bind(settings.host, secured=not auth.insecure, insecure=settings.insecure, what="gRPC server")
        # Without one, spans go to the global tracer provider (a no-op unless the process set one).
        self.telemetry = telemetry or Telemetry.disabled(bindings[0].full_name if bindings else "grpc")
        opts: list[tuple[str, int]] = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # Off unless asked: a second server on a taken port must fail, not silently take half its connections.
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            *settings.grpc_options(),
        ]
        # auth None: only test servers of non-kvbridge services (grpc's own single pool bounds them).
        self.limiter = RpcLimiter(settings.rpc_limits(), self.telemetry.registry) if auth is not None else None
        self.server = grpc.aio.server(
            options=opts,
            # With a limiter, grpc's own pool is only a backstop: it counts RPCs before anyone knows their caller
            # (the ones about to be refused too), so at the limiter's total it would refuse engines for tenants.
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs * (1 if self.limiter is None else 2),
            interceptors=[
                self.telemetry.server_interceptor(),
                *([AuthzInterceptor(auth, self.limiter)] if auth is not None else []),
                DecodeGuardInterceptor(),
            ],
        )
        self.health = ListingHealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [b.full_name for b in bindings]
        for b in bindings:
            b.add_to_server(b.servicer, self.server)
        enable_reflection(self.server, [*names, HEALTH])
        self._names = names
        credentials = server_credentials(settings)
        bind = f"{settings.host}:{port}"
        self.port = (
            self.server.add_secure_port(bind, credentials)
            if credentials is not None
            else self.server.add_insecure_port(bind)
        )
        if self.port == 0:
            raise OSError(f"cannot bind gRPC port {settings.host}:{port}")

    @property
    def address(self) -> str:
        return f"{self._settings.host}:{self.port}"

    async def _set_all(self, status: int) -> None:
        for name in ["", *self._names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.server.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC serving %s on %s", ", ".join(self._names), self.address)

    async def stop(self, grace_s: float | None = None) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self._settings.shutdown_grace_s if grace_s is None else grace_s)

    async def wait(self) -> None:
        await self.server.wait_for_termination()
