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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings, StoreSettings
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


def _gateway_for_engines(gw: GatewaySettings, engines: LocalEngines) -> GatewaySettings:
    """Connector mode: the connector registers retained KV (not the gateway) and entries serve many reads.
    Engines spin both cores of a small machine, hence the generous health and control-plane timeouts.
    The gateway tokenizes with the generated model's own tokenizer (no /tokenize round trip per turn)."""
    return gw.model_copy(update={
        "hash_secret_hex": engines.config.hash_secret_hex, "default_block_size": BLOCK_SIZE,
        "tokenizers": {**gw.tokenizers, SERVED_MODEL_NAME: engines.model_dir},
        "compat_registration": False, "single_use_entries": False,
        "health_timeout_s": max(gw.health_timeout_s, 10.0), "control_timeout_s": max(gw.control_timeout_s, 5.0),
    })


def _load_tokenizer(model_dir: Path) -> None:
    importlib.import_module("transformers").AutoTokenizer.from_pretrained(str(model_dir))


class Stack:
    def __init__(self, config: StackConfig, progress: Callable[[str], None] = lambda _msg: None) -> None:
        self.config = config
        self._progress = progress
        self.store: Store | None = None
        self.lease: LeaseApp | None = None
        self.registry: RegistryApp | None = None
        self.gateway: GatewayApp | None = None
        self.engines: LocalEngines | None = None

    async def start(self, *, leader_timeout_s: float = 15.0) -> None:
        cfg = self.config
        keys = KeyLayout(cfg.store.etcd_prefix)
        auth = Authenticator.from_file(cfg.server.api_keys_file)
        where = ",".join(cfg.store.etcd_endpoints) if cfg.store.etcd_endpoints else (
            f"embedded (WAL in {cfg.data_dir})" if cfg.data_dir else "embedded (in memory)")
        self._progress(f"store: {where}")
        self.store = open_store(cfg.store, data_dir=cfg.data_dir)
        # Engines busy-spin the cores: a generous leader TTL keeps the only lease manager leader while they run.
        policy = (LeasePolicy(port=cfg.lease_port, leader_ttl_s=15, leader_refresh_s=1) if cfg.engines
                  else LeasePolicy(port=cfg.lease_port))
        # Each service keeps its own tracer (service.name) and metrics registry, as when run separately.
        self.lease = LeaseApp(self.store, policy, cfg.server, auth=auth, keys=keys,
                              telemetry=Telemetry.from_env("kvbridge-lease"))
        await self.lease.start()
        deadline = time.monotonic() + leader_timeout_s
        while not self.lease.is_leader:
            if time.monotonic() > deadline:
                raise TimeoutError("the lease manager did not become leader in time (another leader on this store?)")
            await asyncio.sleep(0.05)
        self._progress(f"lease manager: {self.lease.address} (leader)")
        reg_settings = RegistrySettings(port=cfg.registry_port, lease_service_target=self.lease.address)
        self.registry = RegistryApp(
            self.store, settings=reg_settings, server_settings=cfg.server, keys=keys, auth=auth,
            store_timeout_s=cfg.store.etcd_timeout_s, telemetry=Telemetry.from_env("kvbridge-registry"),
        )
        await self.registry.start()
        self._progress(f"registry: {self.registry.address}")
        if cfg.engines is not None:
            self.engines = LocalEngines(cfg.engines, self._progress)
            await self.engines.build_model()  # before the gateway, which loads the model's tokenizer
            if cfg.gateway is not None:
                # The gateway loads that tokenizer on the loop; transformers' first imports take 20-30 s on a busy
                # 2-core machine: done here off the loop first, or they stall the lease manager's election (it
                # stepped down) and the registry's index follower.
                await asyncio.to_thread(_load_tokenizer, self.engines.model_dir)
        if cfg.gateway is not None:
            gw = cfg.gateway.model_copy(
                update={"registry_address": self.registry.address, "lease_address": self.lease.address}
            )
            if self.engines is not None:
                gw = _gateway_for_engines(gw, self.engines)
            self.gateway = GatewayApp(gw, auth=auth, server_settings=cfg.server,
                                      telemetry=Telemetry.from_env("kvbridge-gateway"))
            await self.gateway.start()
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
                raise TimeoutError(f"the gateway found no healthy prefill+decode pair in the registry within "
                                   f"{self.config.gateway_ready_timeout_s:.0f}s (see the engine logs)")
            await asyncio.sleep(0.5)
        self._progress("gateway: routing to the prefill and decode engines")

    async def stop(self) -> None:
        if self.engines is not None:
            await self.engines.stop()
        for app in (self.gateway, self.registry, self.lease):
            if app is not None:
                try:
                    await app.stop()
                except Exception:
                    log.warning("stopping %s failed", type(app).__name__, exc_info=True)
        if self.store is not None:
            await self.store.close()
        for app in (self.gateway, self.registry, self.lease):
            if app is not None:
                await asyncio.to_thread(app.telemetry.shutdown)  # flushing spans blocks
