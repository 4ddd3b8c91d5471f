"""The etcd key layout, in one place (every service shares one store).

All keys live under a versioned prefix (default ``/kvbridge/v1``). Path
components chosen by users (tenant, model, conversation key) are
percent-encoded so that ``/`` inside them cannot escape their level and prefix
scans stay exact.

    <prefix>/registry/engines/<engine_id>                  types.v1.Engine
    <prefix>/registry/entries/<tenant>/<model>/<conv_key>  registry.v1.Entry
    <prefix>/registry/requests/<request_id>                idempotency record
    <prefix>/registry/closed/<tenant>/<model>/<conv_key>   close tombstone (epoch; expires)
    <prefix>/lease/leases/<lease_id:016x>                  lease.v1.Lease
    <prefix>/<service>/leader                              leader election
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from kvbridge.lease.v1 import lease_pb2


def _q(component: str) -> str:
    return quote(component, safe="")


class KeyLayout:
    def __init__(self, prefix: str = "/kvbridge/v1") -> None:
        self.prefix = prefix.rstrip("/")

    def _k(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    # registry
    def engine(self, engine_id: str) -> bytes:
        return self._k("registry", "engines", _q(engine_id))

    def engines_prefix(self) -> bytes:
        return self._k("registry", "engines", "")

    def entry(self, tenant: str, model: str, conversation_key: str) -> bytes:
        return self._k("registry", "entries", _q(tenant), _q(model), _q(conversation_key))

    def entries_prefix(self, tenant: str | None = None, model: str | None = None) -> bytes:
        parts = ["registry", "entries"]
        if tenant is not None:
            parts.append(_q(tenant))
            if model is not None:
                parts.append(_q(model))
        return self._k(*parts, "")

    def parse_entry(self, key: bytes) -> tuple[str, str, str]:
        """(tenant, model, conversation_key) of an entry key."""
        rest = key.decode()[len(self.entries_prefix().decode()) :]
        tenant, model, conv = rest.split("/")
        return unquote(tenant), unquote(model), unquote(conv)

    def closed(self, tenant: str, model: str, conversation_key: str) -> bytes:
        """A closed conversation's tombstone: registrations of an epoch up to the close are refused."""
        return self._k("registry", "closed", _q(tenant), _q(model), _q(conversation_key))

    def registry_request(self, request_id: str) -> bytes:
        return self._k("registry", "requests", _q(request_id))

    # lease manager
    def lease(self, lease_id: int) -> bytes:
        return self._k("lease", "leases", f"{lease_id:016x}")

    def leases_prefix(self) -> bytes:
        return self._k("lease", "leases", "")

    def leader(self, service: str) -> bytes:
        return self._k(_q(service), "leader")


# Soft state (ADR 0024): per-turn entries, their idempotency records and close tombstones, and every lease but
# the engines' node leases (their incarnations). A store that starts a new generation (repaired, restored, rolled
# back) retires these, whatever the prefix.
SOFT_STATE_SEGMENTS = (b"/registry/entries/", b"/registry/requests/", b"/registry/closed/")
LEASES_SEGMENT = b"/lease/leases/"


def is_soft_state(key: bytes, value: bytes) -> bool:
    if any(segment in key for segment in SOFT_STATE_SEGMENTS):
        return True
    if LEASES_SEGMENT not in key:
        return False
    try:
        return bool(lease_pb2.Lease.FromString(value).kind != lease_pb2.LEASE_KIND_NODE)
    except Exception:  # noqa: BLE001 - an unreadable lease record is retired too
        return True
