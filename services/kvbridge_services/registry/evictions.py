"""Removing indexed entries from the store: the per-tenant cap's evictions, a previous incarnation's entries.

Each delete is conditional on the revision the index holds, so an entry rewritten meanwhile is kept; the
lease of a deleted entry is revoked off the RPC's path (``releaser.py``).
"""

from __future__ import annotations

import logging

from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.base import Compare, Delete

from .index import EntryId, IndexedEntry
from .parts import RegistryParts

log = logging.getLogger(__name__)
# Why the registry itself removed an entry (a label of kvbridge_registry_entries_evicted_total).
EVICTED_TENANT_CAP = "tenant_cap"


class EntryEvictor:
    def __init__(self, parts: RegistryParts, *, max_entries_per_tenant: int) -> None:
        self._parts = parts
        self._cap = max_entries_per_tenant
        self.evictions: dict[str, int] = {}  # entries the registry removed itself, by reason (never loss)

    async def make_room(self, tenant: str, incoming: EntryId) -> None:
        """Per-tenant cap: evict the tenant's oldest-idle entries (leases revoked with BUDGET) until ``incoming``
        fits. An entry already indexed under ``incoming``'s key (a previous incarnation's) is replaced by the
        write, so the count does not grow: decided on the index, the same view the count comes from.

        An eviction is recorded, so that it is never mistaken for loss: counted in ``evictions``
        (``kvbridge_registry_entries_evicted_total{reason="tenant_cap"}``) and logged (INFO) with the entry.
        """
        cap, index = self._cap, self._parts.index
        adds = 0 if incoming in index.entries else 1
        while index.tenant_count(tenant) + adds > cap:
            victim = index.oldest_idle(tenant, exclude=incoming)
            if victim is None:
                return
            if await self.delete_indexed(victim, types_pb2.REVOKE_REASON_BUDGET):
                self.evictions[EVICTED_TENANT_CAP] = self.evictions.get(EVICTED_TENANT_CAP, 0) + 1
                log.info(
                    "evicted entry %s (tenant at its cap of %d entries; oldest idle; lease %x revoked: BUDGET)",
                    "/".join(victim.id),
                    cap,
                    victim.entry.lease_id,
                )

    async def delete_indexed(
        self, item: IndexedEntry, reason: types_pb2.RevokeReason.ValueType, *also: Compare
    ) -> bool:
        """Deletes ``item`` if unchanged in the store (and ``also`` holds), revoking its lease with ``reason``."""
        key = self._parts.keys.entry(*item.id)
        result = await self._parts.store.txn(
            [Compare.mod_revision_is(key, item.mod_revision), *also], [Delete(key)], timeout=self._parts.timeout_s
        )
        # Either we deleted it, or it changed/vanished in the store; the watch brings the truth.
        self._parts.index.delete_entry(item.id, result.revision if result.succeeded else item.mod_revision + 1)
        if result.succeeded:
            self._parts.revoker.submit(item.entry.lease_id, reason)
        return result.succeeded
