"""GatewayApp: the gateway assembled in-process (HTTP + gRPC on one core), for ``__main__`` and tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from kvbridge import secret as kvsecret
from kvbridge.gateway.v1 import gateway_pb2_grpc
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings
from kvbridge_services.common.server import GrpcServer, ServiceBinding
from kvbridge_services.common.telemetry import Telemetry

from .config import GatewaySettings
from .control import ControlPlane
from .grpc_api import GatewayServicer
from .http_api import build_http_app
from .httpserver import protocol_class
from .service import GatewayCore

log = logging.getLogger(__name__)
SERVICE_NAME = "kvbridge.gateway.v1.GatewayService"


def deployment_secret(settings: GatewaySettings, auth: Authenticator) -> bytes:
    """The deployment secret (kvbridge.secret). Required with API keys: a random per-replica secret there would
    silently give 0 % reuse (every replica and connector hashes under its own). In development mode (no keys)
    a random one, with a warning."""
    if settings.hash_secret_hex:
        return kvsecret.parse(settings.hash_secret_hex, setting=kvsecret.ENV)
    if not auth.insecure:
        raise ValueError(
            f"{kvsecret.ENV} is required when API keys are configured: the hex deployment secret "
            "every gateway replica and connector shares (e.g. `openssl rand -hex 32`)"
        )
    log.warning(
        "no %s configured (development mode): using a random secret; no entry registered by a connector "
        "will verify, and restarts lose reuse",
        kvsecret.ENV,
    )
    return bytes.fromhex(kvsecret.generate())


class GatewayApp:
    """``await app.start()`` binds HTTP and gRPC (port 0 picks free ports); ``await app.stop()``."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        auth: Authenticator | None = None,
        server_settings: ServerSettings | None = None,
        telemetry: Telemetry | None = None,
        peer_tls: PeerTlsSettings | None = None,
    ) -> None:
        """``peer_tls``: TLS towards the registry and lease manager (None: plaintext)."""
        self.settings = settings
        # Tracing (OTEL_*, set up by the composition root) and the registry behind /metrics.
        self.telemetry = telemetry or Telemetry.disabled("kvbridge-gateway")
        auth = auth or Authenticator.from_file(settings.api_keys_file)
        secret = deployment_secret(settings, auth)
        control = ControlPlane(
            settings.registry_address,
            settings.lease_address,
            api_key=settings.control_api_key,
            timeout_s=settings.control_timeout_s,
            tracer=self.telemetry.tracer,
            tls=peer_tls,
            registry_connections=settings.registry_connections,
        )
        self.core = GatewayCore(settings, auth, control, secret, telemetry=self.telemetry)
        self.http_app = build_http_app(self.core)
        grpc_settings = (server_settings or ServerSettings()).model_copy(update={"host": settings.host})
        self._grpc = GrpcServer(
            grpc_settings,
            settings.grpc_port,
            [
                ServiceBinding(
                    SERVICE_NAME, GatewayServicer(self.core), gateway_pb2_grpc.add_GatewayServiceServicer_to_server
                )
            ],
            telemetry=self.telemetry,
            auth=auth,
        )
        # Slow clients: uvicorn closes idle keep-alive connections; the header deadline and size cap are
        # httpserver.py's; the body's deadline and the slots are the routes' (http_api.py).
        header_timeouts = self.http_app.state.metrics.timeouts.labels("headers")
        protocol = protocol_class(lambda: settings.header_timeout_s, header_timeouts.inc)
        config = uvicorn.Config(
            self.http_app,
            host=settings.host,
            port=settings.http_port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=settings.keep_alive_timeout_s,
            http=protocol,
        )
        self._http = uvicorn.Server(config)
        self._http_task: asyncio.Task[None] | None = None

    @property
    def http_url(self) -> str:
        servers = getattr(self._http, "servers", [])
        port: int = servers[0].sockets[0].getsockname()[1] if servers else self.settings.http_port
        return f"http://{self.settings.host}:{port}"

    @property
    def grpc_address(self) -> str:
        return str(self._grpc.address)

    async def start(self) -> None:
        await self.core.start()
        await self._grpc.start()
        self._http_task = asyncio.create_task(self._http.serve())
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise OSError("HTTP server exited at start")
            await asyncio.sleep(0.01)
        log.info("gateway HTTP on %s, gRPC on %s", self.http_url, self.grpc_address)

    async def stop(self) -> None:
        self._http.should_exit = True
        if self._http_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._http_task
        await self._grpc.stop(1.0)
        await self.core.stop()
        await asyncio.to_thread(self.telemetry.force_flush)  # exporting blocks: off the event loop

    async def wait(self) -> None:
        if self._http_task is not None:
            await self._http_task
