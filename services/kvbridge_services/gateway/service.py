"""The gateway core both front doors share: auth, pools, control plane, router, background loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvbridge import ids
from kvbridge_services.common.auth import Authenticator, Principal
from kvbridge_services.common.metric_factory import MetricFactory
from kvbridge_services.common.telemetry import Telemetry

from .config import GatewaySettings
from .control import ControlPlane, ControlPlaneError
from .engines import DECODE, PREFILL, EnginePool
from .kvparams import cache_salt_key
from .metrics import GatewayMetrics, engine_label
from .mirror import EntryMirror, follow_registry
from .requests import Limits
from .router import TurnRouter
from .staticengines import Route, StaticEngines, routes
from .tokenizer import LocalTokenizers
from .upstream import EngineHttp

log = logging.getLogger(__name__)

# Service principals (an ingress acting for end users) name the tenant with this header / metadata key.
TENANT_HEADER = "x-kvbridge-tenant"
DEFAULT_TENANT = "default"
_MIRROR_STREAM_LIFETIME_S = 600.0  # each entry watch's deadline; the next one starts with a fresh snapshot


class GatewayCore:
    def __init__(
        self,
        settings: GatewaySettings,
        auth: Authenticator,
        control: ControlPlane,
        secret: bytes,
        *,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.auth = auth
        self.control = control
        self.telemetry = telemetry or Telemetry.disabled("kvbridge-gateway")
        self.metrics = GatewayMetrics(self.telemetry.registry)
        self.http = EngineHttp(connect_timeout_s=settings.connect_timeout_s)
        self.pool = EnginePool(
            self.http, health_timeout_s=settings.health_timeout_s, kv_usage_weight=settings.kv_usage_weight
        )
        # Loaded now: a tokenizer directory that does not load stops the gateway at start (TokenizerConfigError).
        self.tokenizers = (
            LocalTokenizers(settings.tokenizers, prefix_cache_bytes=settings.tokenizer_prefix_cache_mb * 1024 * 1024)
            if settings.tokenizers
            else None
        )
        if self.tokenizers is not None:
            log.info("local tokenization for models: %s", ", ".join(self.tokenizers.models()))
            tokenizers = self.tokenizers
            self.metrics.tokenize_reused_tokens.set_function(lambda: float(tokenizers.reused_tokens()))
        self.mirror = (
            EntryMirror(
                max_entries=settings.entry_mirror_max_entries, stale_after_s=settings.entry_mirror_stale_after_s
            )
            if settings.entry_mirror and control.enabled and settings.reuse_enabled
            else None
        )
        if self.mirror is not None:
            mirror = self.mirror
            self.metrics.mirror_entries.set_function(lambda: len(mirror))
            self.metrics.mirror_in_sync.set_function(lambda: 1.0 if mirror.in_sync() else 0.0)
            self.metrics.mirror_lag.set_function(lambda: -1.0 if (lag := mirror.lag_s()) is None else lag)
        self.router = TurnRouter(
            settings,
            self.pool,
            control,
            self.http,
            self.metrics,
            secret,
            telemetry=self.telemetry,
            tokenizers=self.tokenizers,
            mirror=self.mirror,
        )
        self.limits = Limits(
            max_messages=settings.max_messages,
            max_prompt_tokens=settings.max_prompt_tokens,
            cache_salt_key=cache_salt_key(secret),  # every replica salts a tenant's engine requests alike
        )
        self.inflight = 0
        self._tasks: list[asyncio.Task[None]] = []
        # Engines given by URL: stock engines the gateway registers (compatibility mode, ADR 0027).
        self.static = StaticEngines(
            settings,
            self.pool,
            control,
            self.http,
            MetricFactory(self.metrics.registry),
            forget_clock=self.router.forget_clock,
        )

    def tenant_of(self, principal: Principal, requested: str | None) -> str:
        if principal.tenant is not None:
            return str(principal.tenant_for(requested or "", field=TENANT_HEADER))
        return ids.TENANT.check(TENANT_HEADER, requested or DEFAULT_TENANT)

    def models(self) -> set[str]:
        return {m for m in self.pool.models() if self.pool.count(m, PREFILL) or self.pool.count(m, DECODE)}

    def ready(self) -> bool:
        return any(self.pool.count(m, PREFILL) and self.pool.count(m, DECODE) for m in self.pool.models())

    def routes(self) -> list[Route]:
        """Every engine this gateway routes to: URL, role, model, mode and who registered it."""
        return routes(self.pool, self.static.members)

    def update_engine_gauges(self) -> None:
        for e in self.pool.all():
            self.metrics.engine_healthy.labels(e.role, engine_label(e.engine_id, e.url)).set(1 if e.healthy else 0)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.static.start()  # StaticEngineError: an engine given by URL states too little to register it
        await self._refresh_registry()
        await self.pool.check_all()
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if self.control.enabled and self.settings.engines_from_registry:
            self._tasks.append(asyncio.create_task(self._registry_loop()))
        if self.static.registering:
            self._tasks.append(asyncio.create_task(self.static.lease_loop()))
        if self.mirror is not None:
            self._tasks.append(
                asyncio.create_task(
                    follow_registry(
                        self.control,
                        self.mirror,
                        progress_interval_s=self.settings.entry_mirror_stale_after_s / 3,
                        stream_lifetime_s=_MIRROR_STREAM_LIFETIME_S,
                    )
                )
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception:  # a loop that died must not stop the shutdown
                log.exception("background task failed")
        self._tasks.clear()
        await self.static.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.router.close(), timeout=5)
        await self.http.aclose()
        await self.control.close()
        if self.tokenizers is not None:
            self.tokenizers.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.pool.check_all()
                self.static.after_health_check()
            except Exception:
                log.exception("health check round failed")

    async def _refresh_registry(self) -> None:
        if not (self.control.enabled and self.settings.engines_from_registry):
            return
        try:
            records = await self.control.list_engines()
        except ControlPlaneError as exc:
            log.warning("cannot list engines from the registry: %s", exc)
            return
        self.pool.sync_registry(records)
        for record in records:
            self.router.canary.check(record)  # logged at ERROR when the gateway first learns of the engine

    async def _registry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry_refresh_s)
            await self._refresh_registry()
            new = [e for e in self.pool.all() if e.last_check == 0.0]
            if new:
                await asyncio.gather(*(self.pool.check(e) for e in new))
