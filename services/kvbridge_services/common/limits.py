"""Concurrent RPCs and streams per principal: no tenant can take the slots engines and services need.

One :class:`RpcLimiter` per gRPC server, consulted by the authorization interceptor (kvbridge_services.common.authz)
once the caller is known. Every RPC, unary or streaming, holds one slot from its admission to its end, in one of
three classes:

- **tenant**: principals with the tenant role. One tenant holds at most ``per_tenant`` slots (all its keys
  together: the principal is the tenant), and all tenants together at most ``tenant_pool``.
- **service**: engine, gateway and operator principals. They are trusted and bounded only by ``total``; since
  tenants never hold more than ``tenant_pool`` and public callers never more than ``public``, at least
  ``total - tenant_pool - public`` slots are always left to them (ADR 0025).
- **public**: health and reflection, which need no credentials; at most ``public`` at once.

A refusal is RESOURCE_EXHAUSTED, reason OVERLOADED, with ErrorInfo metadata ``limit`` (``per_tenant``,
``tenant_pool``, ``public`` or ``total``) and ``max``, so a client can tell its own cap from a busy server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvbridge.errors import Reason, ResourceExhausted

from .auth import Principal
from .metric_factory import MetricFactory

log = logging.getLogger(__name__)

TENANT, SERVICE, PUBLIC = "tenant", "service", "public"


@dataclass(frozen=True, slots=True)
class RpcLimits:
    total: int  # every admitted RPC (ServerSettings.max_concurrent_rpcs)
    tenant_pool: int  # all tenant principals together
    per_tenant: int  # one tenant
    public: int  # health and reflection

    def __post_init__(self) -> None:
        if not 1 <= self.per_tenant <= self.tenant_pool or self.tenant_pool + self.public >= self.total:
            raise ValueError(
                f"RPC limits: need 1 <= per_tenant ({self.per_tenant}) <= tenant_pool ({self.tenant_pool}) and "
                f"tenant_pool + public ({self.public}) < total ({self.total}), so that services keep a share"
            )

    @property
    def service_reserve(self) -> int:
        """Slots no tenant or public caller can take."""
        return self.total - self.tenant_pool - self.public


class Slot:
    """One admitted RPC's slot; ``release`` is idempotent."""

    __slots__ = ("_cls", "_held", "_key", "_limiter")

    def __init__(self, limiter: RpcLimiter, cls: str, key: str) -> None:
        self._limiter, self._cls, self._key = limiter, cls, key
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release(self._cls, self._key)


class RpcLimiter:
    def __init__(self, limits: RpcLimits, registry: CollectorRegistry | None = None) -> None:
        self.limits = limits
        self.in_use = 0
        self.by_class = {TENANT: 0, SERVICE: 0, PUBLIC: 0}
        self.by_tenant: dict[str, int] = {}  # only tenants holding a slot: bounded by tenant_pool
        self._refused: Counter | None = None
        if registry is not None:
            self._register(registry)

    def _register(self, registry: CollectorRegistry) -> None:
        m = MetricFactory(registry)
        try:
            refused = m.counter(
                "kvbridge_grpc_server_limited_total",
                "RPCs refused with RESOURCE_EXHAUSTED / OVERLOADED by a concurrency limit, by limit",
                ["limit"],
            )
            admitted = m.gauge("kvbridge_grpc_server_admitted", "RPCs holding a slot now, by class", ["class"])
        except ValueError:  # a second server on one service's registry (tests): the first one's figures stay
            log.debug("RPC limiter metrics already registered in this registry; not exported for this server")
            return
        self._refused = refused
        for cls in self.by_class:
            admitted.labels(cls).set_function(self._count_of(cls))

    def _count_of(self, cls: str) -> Callable[[], float]:
        return lambda: float(self.by_class[cls])

    def admit(self, principal: Principal | None) -> Slot:
        """A slot for one RPC of ``principal`` (None: a public method), or ResourceExhausted."""
        lim = self.limits
        if self.in_use >= lim.total:
            self._refuse("total", lim.total, "the server is at its limit of concurrent RPCs; retry later")
        if principal is None:
            if self.by_class[PUBLIC] >= lim.public:
                self._refuse("public", lim.public, "too many health/reflection calls at once; retry later")
            return self._take(PUBLIC, "")
        tenant = principal.tenant
        if tenant is None:
            return self._take(SERVICE, "")
        held = self.by_tenant.get(tenant, 0)
        if held >= lim.per_tenant:
            self._refuse(
                "per_tenant",
                lim.per_tenant,
                f"tenant {tenant!r} holds {held} concurrent RPCs/streams, its limit; end one (close idle streams) "
                "before opening another",
            )
        if self.by_class[TENANT] >= lim.tenant_pool:
            self._refuse("tenant_pool", lim.tenant_pool, "tenants hold their share of this server's RPCs; retry later")
        self.by_tenant[tenant] = held + 1
        return self._take(TENANT, tenant)

    def _take(self, cls: str, key: str) -> Slot:
        self.in_use += 1
        self.by_class[cls] += 1
        return Slot(self, cls, key)

    def _release(self, cls: str, key: str) -> None:
        self.in_use -= 1
        self.by_class[cls] -= 1
        if cls == TENANT:
            left = self.by_tenant[key] - 1
            if left:
                self.by_tenant[key] = left
            else:
                del self.by_tenant[key]

    def _refuse(self, limit: str, maximum: int, message: str) -> None:
        if self._refused is not None:
            self._refused.labels(limit).inc()
        raise ResourceExhausted(Reason.OVERLOADED, message, metadata={"limit": limit, "max": str(maximum)})
