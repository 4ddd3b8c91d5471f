"""The all-in-one local stack: lease manager, registry and (optionally) gateway
in one process, sharing one store (embedded by default, etcd when configured),
each on its own gRPC port with the same API as when run separately; optionally
one prefill + one decode vLLM CPU engine (child process groups) with the
kvbridge connector, which register themselves and are routed by the gateway.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings, StoreSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store import Store, open_store
from kvbridge_services.common.telemetry import Telemetry
from kvbridge_services.devengines.launcher import BLOCK_SIZE, SERVED_MODEL_NAME
from kvbridge_services.devengines.local import LocalEngines, LocalEnginesConfig
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings

log = logging.getLogger(__name__)
# The registry's and lease manager's /metrics ports when run alone (their __main__'s DEFAULT_METRICS_PORT).
REGISTRY_METRICS_PORT = 9151
LEASE_METRICS_PORT = 9152


@dataclass
class StackConfig:
    store: StoreSettings = field(default_factory=StoreSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    # Embedded store only: where its write-ahead log lives (None: memory only).
    data_dir: Path | None = None
    registry_port: int = 50051
    lease_port: int = 50052
    # None: no gateway.
    gateway: GatewaySettings | None = None
    # None: no vLLM engines.
    engines: LocalEnginesConfig | None = None
    # How long the gateway may take to see the engines after they answer /health.
    gateway_ready_timeout_s: float = 60.0
    # /metrics of the registry and the lease manager (the gateway's is on its HTTP port). None: 9151 and 9152, as
    # when each runs alone, for a service on a fixed gRPC port, off for one on port 0 (an ephemeral test stack);
    # KVBRIDGE_REGISTRY_METRICS_PORT / KVBRIDGE_LEASE_METRICS_PORT, when set, decide instead (0: off).
    registry_metrics_port: int | None = None
    lease_metrics_port: int | None = None


def metrics_port(explicit: int | None, grpc_port: int, default: int) -> int:
    """A service's /metrics port in the stack (see ``StackConfig.registry_metrics_port``)."""
    if explicit is not None:
        return explicit
    return default if grpc_port else 0


def _gateway_for_engines(gw: GatewaySettings, engines: LocalEngines) -> GatewaySettings:
    """Connector mode: the connector registers retained KV (not the gateway) and entries serve many reads.
    Engines spin both cores of a small machine, hence the generous health and control-plane timeouts.
    The gateway tokenizes with the generated model's own tokenizer (no /tokenize round trip per turn)."""
    return gw.model_copy(
        update={
            "hash_secret_hex": engines.config.hash_secret_hex,
            "default_block_size": BLOCK_SIZE,
            "tokenizers": {**gw.tokenizers, SERVED_MODEL_NAME: engines.model_dir},
            "compat_registration": False,
            "single_use_entries": False,
            "health_timeout_s": max(gw.health_timeout_s, 10.0),
            "control_timeout_s": max(gw.control_timeout_s, 5.0),
        }
    )


def _load_tokenizer(model_dir: Path) -> None:
    importlib.import_module("transformers").AutoTokenizer.from_pretrained(str(model_dir))


class ServiceStack:
    """The in-process builder of lease manager -> registry -> (optional) gateway on one given store, used by
    ``Stack`` and by every test that needs a stack (one copy of the wiring).

    ``start()`` fills in the addresses (the registry's lease target, the gateway's registry and lease address);
    if any step fails or is cancelled, everything built so far (a half-started app too) is stopped in reverse
    order before the error propagates. ``stop()`` stops gateway, registry, lease manager, each even if an earlier
    one fails, then raises the first failure. The store stays the caller's. Also an async context manager.
    ``auth`` is the lease manager's and registry's, ``gateway_auth`` the gateway's (None: from its keys file);
    ``server`` the lease manager's and registry's server settings, ``gateway_server`` the gateway's gRPC one;
    ``telemetry``: per service name (kvbridge-lease, -registry, -gateway; None: disabled);
    ``stop_grace_s``: the lease manager's and registry's shutdown grace (None: ``server.shutdown_grace_s``)."""

    def __init__(
        self,
        store: Store,
        *,
        lease_policy: LeasePolicy,
        registry: RegistrySettings,
        gateway: GatewaySettings | None = None,
        server: ServerSettings | None = None,
        gateway_server: ServerSettings | None = None,
        auth: Authenticator | None = None,
        gateway_auth: Authenticator | None = None,
        keys: KeyLayout | None = None,
        registry_store_timeout_s: float = 5.0,
        registry_peer_tls: PeerTlsSettings | None = None,
        gateway_peer_tls: PeerTlsSettings | None = None,
        telemetry: Callable[[str], Telemetry | None] | None = None,
        leader_timeout_s: float = 10.0,
        stop_grace_s: float | None = None,
    ) -> None:
        self.store = store
        self._lease_policy, self._registry_settings, self._gateway_settings = lease_policy, registry, gateway
        self._server, self._gateway_server = server or ServerSettings(), gateway_server
        self._auth, self._gateway_auth, self._keys = auth, gateway_auth, keys
        self._registry_store_timeout_s = registry_store_timeout_s
        self._registry_peer_tls, self._gateway_peer_tls = registry_peer_tls, gateway_peer_tls
        self._telemetry = telemetry or (lambda _name: None)
        self._leader_timeout_s, self._stop_grace_s = leader_timeout_s, stop_grace_s
        self.lease: LeaseApp | None = None
        self.registry: RegistryApp | None = None
        self.gateway: GatewayApp | None = None
        self._started: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    async def __aenter__(self) -> ServiceStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await self._guarded(self._start())

    async def start_gateway(self, settings: GatewaySettings) -> GatewayApp:
        """The gateway, after ``start()`` without one (e.g. once the engines' model exists); its registry and
        lease addresses filled in. A failure stops everything, as in ``start()``."""
        await self._guarded(self._start_gateway(settings))
        assert self.gateway is not None
        return self.gateway

    async def _guarded(self, starting: Awaitable[None]) -> None:
        try:
            await starting
        except BaseException:  # cancellation too: nothing started may outlive a failed start
            try:
                await self._stop_all()
            except Exception:
                log.warning("stopping after a failed start failed", exc_info=True)
            raise

    async def _start(self) -> None:
        grace = self._stop_grace_s
        self.lease = lease = LeaseApp(
            self.store,
            self._lease_policy,
            self._server,
            auth=self._auth,
            keys=self._keys,
            telemetry=self._telemetry("kvbridge-lease"),
        )
        self._started.append(("lease manager", lambda: lease.stop(grace)))
        await lease.start()
        try:
            async with asyncio.timeout(self._leader_timeout_s):
                while not lease.is_leader:  # noqa: ASYNC110 - polling the election task
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise TimeoutError(
                "the lease manager did not become leader in time (another leader on this store?)"
            ) from None
        reg = self._registry_settings.model_copy(update={"lease_service_target": lease.address})
        self.registry = registry = RegistryApp(
            self.store,
            settings=reg,
            server_settings=self._server,
            keys=self._keys,
            auth=self._auth,
            store_timeout_s=self._registry_store_timeout_s,
            telemetry=self._telemetry("kvbridge-registry"),
            peer_tls=self._registry_peer_tls,
        )
        self._started.append(("registry", lambda: registry.stop(grace)))
        await registry.start()
        if self._gateway_settings is not None:
            await self._start_gateway(self._gateway_settings)

    async def _start_gateway(self, settings: GatewaySettings) -> None:
        if self.lease is None or self.registry is None or self.gateway is not None:
            raise RuntimeError("start_gateway() needs a started lease manager and registry and no gateway yet")
        gw = settings.model_copy(
            update={"registry_address": self.registry.address, "lease_address": self.lease.address}
        )
        self.gateway = gateway = GatewayApp(
            gw,
            auth=self._gateway_auth,
            server_settings=self._gateway_server,
            telemetry=self._telemetry("kvbridge-gateway"),
            peer_tls=self._gateway_peer_tls,
        )
        self._started.append(("gateway", gateway.stop))
        await gateway.start()

    async def stop(self) -> None:
        """Stops everything started, newest first; raises the first failure once all are stopped."""
        errors = await self._stop_all()
        if errors:
            raise errors[0]

    async def _stop_all(self) -> list[Exception]:
        errors: list[Exception] = []
        while self._started:
            name, stop = self._started.pop()
            try:
                await stop()
            except Exception as exc:
                log.warning("stopping the %s failed", name, exc_info=True)
                errors.append(exc)
        return errors


class Stack:
    def __init__(self, config: StackConfig, progress: Callable[[str], None] = lambda _msg: None) -> None:
        self.config = config
        self._progress = progress
        self.store: Store | None = None
        self.lease: LeaseApp | None = None
        self.registry: RegistryApp | None = None
        self.gateway: GatewayApp | None = None
        self.engines: LocalEngines | None = None
        self.services: ServiceStack | None = None

    async def start(self, *, leader_timeout_s: float = 15.0) -> None:
        cfg = self.config
        keys = KeyLayout(cfg.store.etcd_prefix)
        auth = Authenticator.from_file(cfg.server.api_keys_file)
        where = (
            ",".join(cfg.store.etcd_endpoints)
            if cfg.store.etcd_endpoints
            else (f"embedded (WAL in {cfg.data_dir})" if cfg.data_dir else "embedded (in memory)")
        )
        self._progress(f"store: {where}")
        self.store = open_store(cfg.store, data_dir=cfg.data_dir)
        # Engines busy-spin the cores: a generous leader TTL keeps the only lease manager leader while they run.
        policy = (
            LeasePolicy(port=cfg.lease_port, leader_ttl_s=15, leader_refresh_s=1)
            if cfg.engines
            else LeasePolicy(port=cfg.lease_port)
        )
        registry = RegistrySettings(port=cfg.registry_port)
        # Each service's /metrics, as when it runs alone, unless the environment set its port.
        if "metrics_port" not in policy.model_fields_set:
            port = metrics_port(cfg.lease_metrics_port, cfg.lease_port, LEASE_METRICS_PORT)
            policy = policy.model_copy(update={"metrics_port": port})
        if "metrics_port" not in registry.model_fields_set:
            port = metrics_port(cfg.registry_metrics_port, cfg.registry_port, REGISTRY_METRICS_PORT)
            registry = registry.model_copy(update={"metrics_port": port})
        # Each service keeps its own tracer (service.name) and metrics registry, as when run separately.
        self.services = ServiceStack(
            self.store,
            lease_policy=policy,
            registry=registry,
            server=cfg.server,
            gateway_server=cfg.server,
            auth=auth,
            gateway_auth=auth,
            keys=keys,
            registry_store_timeout_s=cfg.store.etcd_timeout_s,
            telemetry=Telemetry.from_env,
            leader_timeout_s=leader_timeout_s,
        )
        try:
            await self.services.start()
        finally:
            self.lease, self.registry = self.services.lease, self.services.registry
        assert self.lease is not None and self.registry is not None
        self._progress(f"lease manager: {self.lease.address} (leader)")
        self._progress(f"registry: {self.registry.address}")
        for name, app in (("lease manager", self.lease), ("registry", self.registry)):
            if app.metrics_endpoint.url:
                self._progress(f"{name} metrics: {app.metrics_endpoint.url}")
        if cfg.engines is not None:
            self.engines = LocalEngines(cfg.engines, self._progress)
            await self.engines.build_model()  # before the gateway, which loads the model's tokenizer
            if cfg.gateway is not None:
                # The gateway loads that tokenizer on the loop; transformers' first imports take 20-30 s on a busy
                # 2-core machine: done here off the loop first, or they stall the lease manager's election (it
                # stepped down) and the registry's index follower.
                await asyncio.to_thread(_load_tokenizer, self.engines.model_dir)
        if cfg.gateway is not None:
            gw = cfg.gateway if self.engines is None else _gateway_for_engines(cfg.gateway, self.engines)
            try:
                await self.services.start_gateway(gw)
            finally:
                self.gateway = self.services.gateway
            assert self.gateway is not None
            self._progress(f"gateway: {self.gateway.http_url} (HTTP)")
        if self.engines is not None:
            await self.engines.start(self.registry.address, self.lease.address)
            await self._wait_gateway_routes()

    async def _wait_gateway_routes(self) -> None:
        """Until the gateway has found a healthy prefill and decode engine in the registry."""
        if self.gateway is None:
            return
        deadline = time.monotonic() + self.config.gateway_ready_timeout_s
        while not self.gateway.core.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the gateway found no healthy prefill+decode pair in the registry within "
                    f"{self.config.gateway_ready_timeout_s:.0f}s (see the engine logs)"
                )
            await asyncio.sleep(0.5)
        self._progress("gateway: routing to the prefill and decode engines")

    async def stop(self) -> None:
        if self.engines is not None:
            await self.engines.stop()
        if self.services is not None:
            try:
                await self.services.stop()
            except Exception:
                log.warning("stopping the services failed", exc_info=True)
        if self.store is not None:
            await self.store.close()
        # Flushing spans blocks (each bounded: telemetry.SHUTDOWN_TIMEOUT_S): the three at once.
        apps = [app for app in (self.gateway, self.registry, self.lease) if app is not None]
        await asyncio.gather(*(asyncio.to_thread(app.telemetry.shutdown) for app in apps))
