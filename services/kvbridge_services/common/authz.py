"""The RPC x role authorization table, and the one interceptor that enforces it.

Every kvbridge gRPC method has exactly one row in :data:`TABLE`: the roles that may call it. The server
interceptor (:class:`AuthzInterceptor`, installed by kvbridge_services.common.server) authenticates the caller once
per RPC, refuses a role the row does not name with PERMISSION_DENIED / TENANT_FORBIDDEN (metadata ``method``),
refuses every method without a row the same way, admits the RPC under its principal's concurrency limits
(kvbridge_services.common.limits: RESOURCE_EXHAUSTED / OVERLOADED past them), hands the principal to the servicer
(:func:`caller`), and redacts what a tenant may not see (:func:`redact_for_tenant`). Health and reflection are
public (they take a public slot).

A tenant principal's tenant always comes from its credentials (``Principal.tenant_for``); every other role acts
for any tenant and names it in the request. docs/security.md shows this table; tests/unit/common/test_authz.py
checks the page against it and tests/reliability/test_authz_matrix.py calls every RPC with every role.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvbridge.errors import KvbridgeError, PermissionDenied, Reason, Unauthenticated
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from .auth import Authenticator, Principal, Role
from .handler_cache import WrappingInterceptor
from .limits import RpcLimiter, Slot

T, G, E, OP = Role.TENANT, Role.GATEWAY, Role.ENGINE, Role.OPERATOR
_REG = "kvbridge.registry.v1.RegistryService/"
_LEASE = "kvbridge.lease.v1.LeaseService/"
_GW = "kvbridge.gateway.v1.GatewayService/"


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[Role]
    why: str


def _rule(why: str, *roles: Role) -> Rule:
    return Rule(frozenset(roles), why)


# Full gRPC method name -> who may call it (NODE and ENTRY grants alike: only engines hold the row).
TABLE: dict[str, Rule] = {
    _REG + "RegisterEngine": _rule("engines announce themselves", E),
    _REG + "DeregisterEngine": _rule("an engine leaving; an operator removing one", E, OP),
    _REG + "GetEngine": _rule("routing, connectors, inspection (hosts and ports: never tenants)", G, E, OP),
    _REG + "ListEngines": _rule("routing, connectors, inspection (hosts and ports: never tenants)", G, E, OP),
    _REG + "RegisterEntry": _rule("only engines write KV locations", E),
    _REG + "LookupEntry": _rule("tenants look up their own conversations; the gateway for any tenant", T, G),
    _REG + "GetEntry": _rule("block ids and hashes: the gateway's close, connectors, inspection", G, E, OP),
    _REG + "ListEntries": _rule("inspection", OP),
    _REG + "DeleteEntry": _rule("the gateway closing a conversation, an engine, an operator evicting", G, E, OP),
    _REG + "WatchEntries": _rule("the gateway's entry mirror, decode nodes, inspection", G, E, OP),
    _LEASE + "GrantLease": _rule(
        "NODE and ENTRY leases: engines only (in compatibility mode the gateway's key holds the engine role too)", E
    ),
    _LEASE + "KeepAlive": _rule(
        "tenants heartbeat their own conversations; the gateway renews on each turn; engines their node lease", T, G, E
    ),
    _LEASE + "RevokeLease": _rule(
        "the gateway closing, an engine evicting, an operator (and the registry "
        "releasing superseded entries, with any of these keys)",
        G,
        E,
        OP,
    ),
    _LEASE + "GetLease": _rule("inspection", OP),
    _LEASE + "ListLeases": _rule("inspection", OP),
    _LEASE + "WatchLeases": _rule("an engine follows its leases; inspection", E, OP),
    _GW + "CreateChatCompletion": _rule("tenants; the gateway role names the tenant (x-kvbridge-tenant)", T, G),
    _GW + "CreateCompletion": _rule("tenants; the gateway role names the tenant (x-kvbridge-tenant)", T, G),
    _GW + "ListModels": _rule("anyone with a key", T, G, OP),
    _GW + "CloseConversation": _rule("tenants close their own conversations; the gateway role for any", T, G),
}

# Public services: no credentials needed, no row needed.
PUBLIC_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvbridge_caller", default=None)


def rule_for(method: str) -> Rule | None:
    """The row of a method, ``"/pkg.Service/Method"`` or ``"pkg.Service/Method"``."""
    return TABLE.get(method.removeprefix("/"))


def allowed(principal: Principal, method: str) -> bool:
    rule = rule_for(method)
    return rule is not None and not rule.roles.isdisjoint(principal.roles)


def require(principal: Principal, method: str) -> None:
    """PERMISSION_DENIED / TENANT_FORBIDDEN unless the principal holds a role the method's row names."""
    if allowed(principal, method):
        return
    name = method.removeprefix("/")
    rule = rule_for(method)
    needs = (
        "no role (not in the authorization table)"
        if rule is None
        else "role " + " or ".join(sorted(r.value for r in rule.roles))
    )
    raise PermissionDenied(
        Reason.TENANT_FORBIDDEN,
        f"principal {principal.name!r} ({'/'.join(sorted(principal.roles))}) may not call {name}: needs {needs}",
        metadata={"method": name, "roles": ",".join(sorted(principal.roles))},
    )


def caller() -> Principal:
    """The principal the interceptor resolved for the running RPC."""
    principal = _CALLER.get()
    if principal is None:  # a servicer reached without the interceptor: fail closed
        raise Unauthenticated(Reason.UNAUTHENTICATED, "no authenticated caller for this RPC")
    return principal


# --- what tenants may not see -------------------------------------------------------------------------------


def _redact_lookup(response: registry_pb2.LookupEntryResponse) -> registry_pb2.LookupEntryResponse:
    if not response.HasField("location"):
        return response
    out = registry_pb2.LookupEntryResponse()
    out.CopyFrom(response)
    loc = out.location
    engine = loc.engine
    loc.engine.CopyFrom(types_pb2.Engine(engine_id=engine.engine_id, role=engine.role, model=engine.model))
    del loc.block_ids[:]
    loc.engine_request_id = ""
    return out


# Tenant-callable methods whose answers carry more than a tenant may see (block ids, hashes, engine hosts,
# ports, URLs). KeepAlive's answers are filtered by the lease servicer, which alone knows whose lease an id was.
_TENANT_REDACTIONS: dict[str, Callable[[Any], Any]] = {
    _REG + "LookupEntry": _redact_lookup,
}


def redact_for_tenant(method: str, response: Any) -> Any:
    redact = _TENANT_REDACTIONS.get(method.removeprefix("/"))
    return response if redact is None else redact(response)


# --- the interceptor ---------------------------------------------------------------------------------------

Ctx = grpc.aio.ServicerContext[Any, Any]


class AuthzInterceptor(WrappingInterceptor):
    """Authenticates, authorizes and admits every RPC. With a ``limiter`` each RPC (streams for their whole life)
    holds a slot of its principal's class (common/limits.py); health and reflection take a public slot."""

    def __init__(self, auth: Authenticator, limiter: RpcLimiter | None = None) -> None:
        self._auth = auth
        self._limiter = limiter
        super().__init__(self._wrap)

    def _admit(self, method: str, context: Ctx) -> tuple[Principal, Slot | None]:
        principal = self._auth.authenticate(context)
        require(principal, method)
        return principal, (self._limiter.admit(principal) if self._limiter is not None else None)

    def _wrap(self, method: str, h: Any) -> Any:
        if method.startswith(PUBLIC_PREFIXES):
            return self._wrap_public(h)
        if h.unary_unary is not None:
            return h._replace(unary_unary=self._unary(method, h.unary_unary))
        if h.stream_unary is not None:
            return h._replace(stream_unary=self._unary(method, h.stream_unary))
        if h.unary_stream is not None:
            return h._replace(unary_stream=self._streaming(method, h.unary_stream))
        if h.stream_stream is not None:
            return h._replace(stream_stream=self._streaming(method, h.stream_stream))
        return h

    # --- public methods: no credentials, a public slot ---

    def _wrap_public(self, h: Any) -> Any:
        limiter = self._limiter
        if limiter is None:
            return h

        def unary(inner: Callable[[Any, Ctx], Any]) -> Callable[[Any, Ctx], Any]:
            async def behavior(request: Any, context: Ctx) -> Any:
                slot = await _admit_or_abort(context, limiter.admit, None)
                try:
                    return await inner(request, context)
                finally:
                    slot.release()

            return behavior

        def streaming(inner: Callable[[Any, Ctx], Any]) -> Callable[[Any, Ctx], Any]:
            async def behavior(request: Any, context: Ctx) -> AsyncIterator[Any]:
                slot = await _admit_or_abort(context, limiter.admit, None)
                try:
                    result = inner(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:
                        await result
                finally:
                    slot.release()

            return behavior

        if h.unary_unary is not None:
            return h._replace(unary_unary=unary(h.unary_unary))
        if h.stream_unary is not None:
            return h._replace(stream_unary=unary(h.stream_unary))
        if h.unary_stream is not None:
            return h._replace(unary_stream=streaming(h.unary_stream))
        if h.stream_stream is not None:
            return h._replace(stream_stream=streaming(h.stream_stream))
        return h

    # --- kvbridge methods ---

    def _unary(self, method: str, inner: Callable[[Any, Ctx], Any]) -> Callable[[Any, Ctx], Any]:
        async def behavior(request: Any, context: Ctx) -> Any:
            principal, slot = await _admit_or_abort(context, self._admit, method, context)
            token = _CALLER.set(principal)
            try:
                response = await inner(request, context)
            finally:
                _CALLER.reset(token)
                if slot is not None:
                    slot.release()
            return redact_for_tenant(method, response) if principal.tenant is not None else response

        return behavior

    def _streaming(self, method: str, inner: Callable[[Any, Ctx], Any]) -> Callable[[Any, Ctx], Any]:
        async def behavior(request: Any, context: Ctx) -> AsyncIterator[Any]:
            principal, slot = await _admit_or_abort(context, self._admit, method, context)
            tenant = principal.tenant is not None
            # Not reset: a generator may be finalized in another context; each RPC runs in its own task.
            _CALLER.set(principal)
            try:
                result = inner(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield redact_for_tenant(method, item) if tenant else item
                else:
                    await result
            finally:  # the stream's slot is held until it ends, however it ends
                if slot is not None:
                    slot.release()

        return behavior


_A = TypeVar("_A")


async def _admit_or_abort(context: Ctx, admit: Callable[..., _A], *args: Any) -> _A:
    """``admit(*args)``, or the RPC aborted with the KvbridgeError it raised (unauthenticated, forbidden,
    over a limit)."""
    try:
        return admit(*args)
    except KvbridgeError as err:
        await context.abort_with_status(err.to_status())
        raise AssertionError("unreachable") from None


def table_rows(roles: Iterable[Role] = tuple(Role)) -> list[tuple[str, dict[Role, bool], str]]:
    """(method, allowed per role, why) in table order: what docs/security.md shows."""
    order = list(roles)
    return [(method, {r: r in rule.roles for r in order}, rule.why) for method, rule in TABLE.items()]


def markdown_table() -> str:
    """The table as docs/security.md carries it (tests check the page equals this)."""
    roles = list(Role)
    lines = [
        "| RPC | " + " | ".join(r.value for r in roles) + " | why |",
        "| --- | " + " | ".join(":-:" for _ in roles) + " | --- |",
    ]
    for method, ok, why in table_rows(roles):
        lines.append(f"| `{method}` | " + " | ".join("yes" if ok[r] else "-" for r in roles) + f" | {why} |")
    return "\n".join(lines)
