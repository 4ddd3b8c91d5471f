"""Operator reads and deletes of entries, from the store itself (not the index): get one, delete one
(optionally only at an expected epoch), list a tenant's by page."""

from __future__ import annotations

from kvbridge import ids
from kvbridge.errors import FailedPrecondition, NotFound, Reason, invalid_field
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common import validation as cv
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.store.base import Compare, Delete, Put

from . import validation as v
from .cas import CAS_ATTEMPTS, contention
from .page_tokens import decode_page_token, encode_page_token
from .parts import RegistryParts
from .registrar import IdempotencyLease

# Store pages read for one list page at most: a filtered page may come back short, with a token to go on.
_MAX_SCANS = 8
# How long a close tombstone refuses the registrations of the turns it raced (they land within the connector's
# RPC deadlines, seconds); tombstones share one store lease per half of it, so they go after 30-60 s.
CLOSE_TOMBSTONE_TTL_S = 60


class Entries:
    def __init__(self, parts: RegistryParts) -> None:
        self._parts = parts
        self._tombstones = IdempotencyLease(parts.store, CLOSE_TOMBSTONE_TTL_S, parts.timeout_s)

    async def get_entry(self, principal: Principal, key: registry_pb2.EntryKey) -> registry_pb2.Entry:
        v.check_entry_key("key", key)
        tenant = principal.tenant_for(key.tenant, field="key.tenant")
        kv = await self._parts.store.get(
            self._parts.keys.entry(tenant, key.model, key.conversation_key), timeout=self._parts.timeout_s
        )
        if kv is None:
            raise NotFound(Reason.ENTRY_NOT_FOUND, "no entry for this key")
        return registry_pb2.Entry.FromString(kv.value)

    async def delete_entry(
        self,
        principal: Principal,
        key: registry_pb2.EntryKey,
        reason: types_pb2.RevokeReason.ValueType,
        *,
        expected_epoch: int = 0,
    ) -> registry_pb2.Entry:
        """Deletes the conversation's entry (``expected_epoch`` nonzero: only if it has that epoch, in the same
        compare-and-delete, so of several callers that saw the entry exactly one deletes it)."""
        v.check_entry_key("key", key)
        if reason not in types_pb2.RevokeReason.values():
            raise invalid_field("reason", "unknown revoke reason")
        tenant = principal.tenant_for(key.tenant, field="key.tenant")
        store_key = self._parts.keys.entry(tenant, key.model, key.conversation_key)
        # A delete that is not a consume (no expected epoch: a close, an operator's delete) leaves a tombstone at
        # the registry's time: a registration of a turn that began before it is refused when it lands (issue 30).
        tombstone: tuple[Put, ...] = ()
        if not expected_epoch:
            closed_key = self._parts.keys.closed(tenant, key.model, key.conversation_key)
            epoch = int(self._parts.clock() * 1_000_000)
            tombstone = (Put(closed_key, str(epoch).encode(), lease=await self._tombstones.current()),)
        for _ in range(CAS_ATTEMPTS):
            kv = await self._parts.store.get(store_key, timeout=self._parts.timeout_s)
            if kv is None:
                if tombstone:
                    await self._parts.store.txn([], tombstone, timeout=self._parts.timeout_s)
                raise NotFound(Reason.ENTRY_NOT_FOUND, "no entry for this key")
            entry = registry_pb2.Entry.FromString(kv.value)
            if expected_epoch and entry.epoch != expected_epoch:
                raise FailedPrecondition(
                    Reason.STALE_EPOCH,
                    f"stored epoch {entry.epoch} is not the expected {expected_epoch}",
                    metadata={"field": "expected_epoch", "stored_epoch": str(entry.epoch)},
                )
            result = await self._parts.store.txn(
                [Compare.mod_revision_is(store_key, kv.mod_revision)],
                [Delete(store_key), *tombstone],
                timeout=self._parts.timeout_s,
            )
            if result.succeeded:
                self._parts.index.delete_entry((tenant, key.model, key.conversation_key), result.revision)
                self._parts.revoker.submit(entry.lease_id, reason or types_pb2.REVOKE_REASON_OPERATOR)
                return entry
        raise contention()

    async def list_entries(
        self, principal: Principal, request: registry_pb2.ListEntriesRequest
    ) -> registry_pb2.ListEntriesResponse:
        ids.TENANT.check_optional("tenant", request.tenant)
        tenant = principal.tenant_for(request.tenant)
        if request.model:
            ids.MODEL.check("model", request.model)
        if request.engine_id:
            ids.ENGINE_ID.check("engine_id", request.engine_id)
        size = cv.page_size("page_size", request.page_size, default=v.DEFAULT_PAGE_SIZE, maximum=v.MAX_PAGE_SIZE)
        prefix = self._parts.keys.entries_prefix(tenant, request.model or None)
        # The token is bound to the whole query, the engine filter included.
        query = prefix + b"\x00" + request.engine_id.encode()
        after = decode_page_token(request.page_token, query) if request.page_token else None
        out: list[registry_pb2.Entry] = []
        last_key: bytes | None = None
        more = True
        for _ in range(_MAX_SCANS):
            kvs, _rev = await self._parts.store.range_prefix(
                prefix, start_after=after, limit=size + 1 - len(out), timeout=self._parts.timeout_s
            )
            more = len(kvs) > size - len(out)
            for kv in kvs[: size - len(out)]:
                last_key = kv.key
                entry = registry_pb2.Entry.FromString(kv.value)
                if not request.engine_id or entry.engine_id == request.engine_id:
                    out.append(entry)
            after = last_key
            if len(out) >= size or not more:
                break
        token = encode_page_token(query, last_key) if more and last_key is not None else ""
        return registry_pb2.ListEntriesResponse(entries=out, next_page_token=token)
