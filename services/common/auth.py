"""Who is calling: API keys map to principals; tenants come from credentials.

A *tenant principal* acts only for its own tenant: request fields naming a
tenant must be empty or equal to it. A *service principal* (gateway,
connector, operators) acts for any tenant and must name it. With no keys
configured a server runs in insecure development mode: every caller is the
service principal ``dev`` (the embedded single-node default; logged loudly).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kvbridge import ids
from kvbridge.errors import InvalidArgument, PermissionDenied, Reason, Unauthenticated, invalid_field

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_BEARER = "bearer "


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    # None: a service principal that may act for any tenant.
    tenant: str | None

    @property
    def is_service(self) -> bool:
        return self.tenant is None

    def tenant_for(self, requested: str, *, field: str = "tenant") -> str:
        """The tenant a request acts for, checked against the credentials."""
        if self.tenant is None:
            if not requested:
                raise invalid_field(field, "service callers must name the tenant")
            return requested
        if requested and requested != self.tenant:
            raise PermissionDenied(
                Reason.TENANT_FORBIDDEN,
                f"principal {self.name!r} may not act for another tenant",
                metadata={"field": field},
            )
        return self.tenant

    def require_service(self) -> None:
        if self.tenant is not None:
            raise PermissionDenied(
                Reason.TENANT_FORBIDDEN, f"principal {self.name!r} is not a service principal"
            )


DEV_PRINCIPAL = Principal(name="dev", tenant=None)


class Authenticator:
    """Resolves the caller of an RPC from its ``authorization: Bearer <key>`` metadata."""

    def __init__(self, keys: dict[str, Principal]) -> None:
        self._keys = dict(keys)
        if not self._keys:
            log.warning("no API keys configured: INSECURE development mode, every caller is a service principal")

    @property
    def insecure(self) -> bool:
        return not self._keys

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        """Keys file: JSON ``{"<api key>": {"name": "...", "tenant": "acme" | null}}``."""
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
            tenant = spec.get("tenant")
            if tenant is not None and not ids.TENANT.valid(tenant):
                raise ValueError(
                    f"API keys file {path}: 'tenant' of {spec['name']!r} must be null or a tenant id "
                    f"({ids.TENANT.description})"
                )
            keys[key] = Principal(name=spec["name"], tenant=tenant)
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
            value = value[len(_BEARER):].strip()
        return self.authenticate_key(value)


__all__ = ["Principal", "Authenticator", "DEV_PRINCIPAL", "AUTH_METADATA_KEY", "InvalidArgument"]
