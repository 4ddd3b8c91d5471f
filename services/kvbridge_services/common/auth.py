"""Who is calling: API keys map to principals with roles; tenants come from credentials.

Roles (what a caller may do; the RPC x role table is kvbridge_services.common.authz):

- ``tenant``: an application acting for its own tenant only (request fields naming a tenant must be empty or
  equal to it); it looks up, heartbeats and closes its own conversations.
- ``gateway``: routes for any tenant (must name it); ``engine``: a decode/prefill engine's connector, the only
  writer of KV locations; ``operator``: inspects and revokes.

A principal holds the ``tenant`` role alone, or any set of the other three (one service key may be gateway and
engine). With no keys configured a server runs in insecure development mode: every caller is ``dev``, holding
every non-tenant role (it must name the tenant it acts for, like the gateway; logged loudly).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvbridge import ids
from kvbridge.errors import InvalidArgument, PermissionDenied, Reason, Unauthenticated, invalid_field

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_BEARER = "bearer "


class Role(enum.StrEnum):
    TENANT = "tenant"
    GATEWAY = "gateway"
    ENGINE = "engine"
    OPERATOR = "operator"


SERVICE_ROLES = frozenset({Role.GATEWAY, Role.ENGINE, Role.OPERATOR})


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    # Set exactly for the tenant role; None: a principal that acts for any tenant and must name it.
    tenant: str | None
    # Empty: derived (a principal with a tenant holds the tenant role).
    roles: frozenset[Role] = field(default=frozenset())

    def __post_init__(self) -> None:
        roles = self.roles or (frozenset({Role.TENANT}) if self.tenant is not None else frozenset())
        if not roles:
            raise ValueError(f"principal {self.name!r} has no role")
        if Role.TENANT in roles and (len(roles) > 1 or self.tenant is None):
            raise ValueError(f"principal {self.name!r}: the tenant role needs a tenant and excludes other roles")
        if Role.TENANT not in roles and self.tenant is not None:
            raise ValueError(f"principal {self.name!r}: only the tenant role has a tenant")
        object.__setattr__(self, "roles", frozenset(roles))

    def has(self, role: Role) -> bool:
        return role in self.roles

    def tenant_for(self, requested: str, *, field: str = "tenant") -> str:
        """The tenant a request acts for, checked against the credentials."""
        if self.tenant is None:
            if not requested:
                raise invalid_field(field, f"a {'/'.join(sorted(self.roles))} caller must name the tenant")
            return requested
        if requested and requested != self.tenant:
            raise PermissionDenied(
                Reason.TENANT_FORBIDDEN,
                f"principal {self.name!r} may not act for another tenant",
                metadata={"field": field},
            )
        return self.tenant


# Insecure development mode (no keys file): every non-tenant role, so the whole stack works unauthenticated.
DEV_PRINCIPAL = Principal(name="dev", tenant=None, roles=SERVICE_ROLES)


class Authenticator:
    """Resolves the caller of an RPC from its ``authorization: Bearer <key>`` metadata."""

    def __init__(self, keys: dict[str, Principal]) -> None:
        self._keys = dict(keys)
        if not self._keys:
            log.warning("no API keys configured: INSECURE development mode, every caller holds every role")

    @property
    def insecure(self) -> bool:
        return not self._keys

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        """Keys file: JSON ``{"<api key>": {"name": "...", "role": "tenant", "tenant": "acme"}}``.

        ``role`` is one of tenant, gateway, engine, operator; ``roles`` (a list) gives one key several non-tenant
        roles. The tenant role needs ``tenant``; the others must not have one. Files written before roles
        existed: an entry with a tenant and no role is a tenant key; ``"tenant": null`` without a role (the old
        "service principal") is refused, naming the ``role`` field, instead of guessing what it may do.
        """
        if path is None:
            return cls({})
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read API keys file {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"API keys file {path}: expected a JSON object")
        keys: dict[str, Principal] = {}
        for key, spec in raw.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError(f"API keys file {path}: entry for a key lacks a string 'name'")
            keys[key] = _principal(path, spec)
        return cls(keys)

    def authenticate_key(self, api_key: str | None) -> Principal:
        if self.insecure:
            return DEV_PRINCIPAL
        if not api_key:
            raise Unauthenticated(Reason.UNAUTHENTICATED, "missing credentials: send 'authorization: Bearer <api key>'")
        principal = self._keys.get(api_key)
        if principal is None:
            raise Unauthenticated(Reason.UNAUTHENTICATED, "unknown API key")
        return principal

    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        value = None
        for key, val in context.invocation_metadata() or ():
            if key == AUTH_METADATA_KEY:
                value = val if isinstance(val, str) else val.decode("latin-1")
                break
        if value is not None:
            if not value.lower().startswith(_BEARER):
                raise Unauthenticated(Reason.UNAUTHENTICATED, "authorization metadata must be 'Bearer <api key>'")
            value = value[len(_BEARER) :].strip()
        return self.authenticate_key(value)


def _principal(path: Path, spec: dict[str, Any]) -> Principal:
    name = spec["name"]
    where = f"API keys file {path}: {name!r}"
    tenant = spec.get("tenant")
    if tenant is not None and not ids.TENANT.valid(tenant):
        raise ValueError(f"{where}: 'tenant' must be null or a tenant id ({ids.TENANT.description})")
    if "role" in spec and "roles" in spec:
        raise ValueError(f"{where}: give 'role' or 'roles', not both")
    raw_roles = spec.get("roles", [spec["role"]] if "role" in spec else None)
    if raw_roles is None:
        if tenant is None:
            raise ValueError(
                f"{where}: 'tenant': null without a 'role' is the retired service principal; set \"role\" to "
                f'one of gateway, engine, operator (or "roles": [...]), see docs/security.md'
            )
        raw_roles = [Role.TENANT.value]
    if not isinstance(raw_roles, list) or not raw_roles:
        raise ValueError(f"{where}: 'roles' must be a non-empty list")
    roles: set[Role] = set()
    for r in raw_roles:
        try:
            roles.add(Role(r))
        except ValueError:
            raise ValueError(f"{where}: unknown role {r!r} (one of {', '.join(x.value for x in Role)})") from None
    try:
        return Principal(name=name, tenant=tenant, roles=frozenset(roles))
    except ValueError as exc:
        raise ValueError(f"API keys file {path}: {exc}") from None


__all__ = [
    "Role",
    "SERVICE_ROLES",
    "Principal",
    "Authenticator",
    "DEV_PRINCIPAL",
    "AUTH_METADATA_KEY",
    "InvalidArgument",
]
