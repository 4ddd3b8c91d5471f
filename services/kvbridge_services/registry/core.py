"""Registry logic: registrations (durable, CAS on epoch, idempotent), lookups (from memory).

``Registry`` is the one facade the servicer (``service.py``) and the app use; the work lives in
``engines.py`` (engine records), ``registrar.py`` (entry registration, deciding with ``registration.py``),
``lookup.py`` (lookups on the index), ``entries.py`` (operator reads and deletes) and ``evictions.py``
(entries the registry removes itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Store

from . import validation as v
from .batcher import RegistrationBatcher
from .config import RegistrySettings
from .engines import Engines
from .entries import Entries
from .evictions import EntryEvictor
from .index import RegistryIndex
from .lookup import Lookups
from .registrar import Registrar
from .releaser import BackgroundRevoker


class Registry:
    def __init__(
        self,
        store: Store,
        keys: KeyLayout,
        settings: RegistrySettings,
        index: RegistryIndex,
        revoker: BackgroundRevoker,
        *,
        store_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        group_commit: bool = False,
    ) -> None:
        self.index = index
        self.limits = v.Limits(settings.max_blocks_per_chain, settings.max_kv_groups)
        evictor = EntryEvictor(
            store,
            keys,
            index,
            revoker,
            max_entries_per_tenant=settings.max_entries_per_tenant,
            timeout_s=store_timeout_s,
        )
        # The same dict the evictor counts in: the metrics read it live.
        self.evictions: dict[str, int] = evictor.evictions
        self._engines = Engines(
            store,
            keys,
            index,
            evictor,
            self.limits,
            max_engines=settings.max_engines,
            timeout_s=store_timeout_s,
            clock=clock,
        )
        self._registrar = Registrar(
            store,
            keys,
            settings,
            index,
            revoker,
            evictor,
            self.limits,
            timeout_s=store_timeout_s,
            clock=clock,
            group_commit=group_commit,
        )
        self._lookups = Lookups(index, self.limits, max_content_candidates=settings.max_content_candidates, clock=clock)
        self._entries = Entries(store, keys, index, revoker, timeout_s=store_timeout_s)

    @property
    def batcher(self) -> RegistrationBatcher[registry_pb2.RegisterEntryResponse] | None:
        return self._registrar.batcher

    async def close(self) -> None:
        """Stop group commit; registrations still queued are answered UNAVAILABLE."""
        await self._registrar.close()
        await self._engines.close()

    # ------------------------------------------------------------------ engines

    async def register_engine(self, principal: Principal, engine: types_pb2.Engine) -> types_pb2.Engine:
        return await self._engines.register_engine(principal, engine)

    async def drop_other_incarnations(self, engine_id: str) -> int:
        return await self._engines.drop_other_incarnations(engine_id)

    async def deregister_engine(self, principal: Principal, engine_id: str) -> None:
        await self._engines.deregister_engine(principal, engine_id)

    async def sweep_engines(self) -> int:
        return await self._engines.sweep_engines()

    def get_engine(self, engine_id: str) -> types_pb2.Engine:
        return self._engines.get_engine(engine_id)

    def list_engines(self, request: registry_pb2.ListEnginesRequest) -> registry_pb2.ListEnginesResponse:
        return self._engines.list_engines(request)

    # ------------------------------------------------------------------ register

    async def register_entry(
        self, principal: Principal, request: registry_pb2.RegisterEntryRequest
    ) -> registry_pb2.RegisterEntryResponse:
        return await self._registrar.register_entry(principal, request)

    # ------------------------------------------------------------------ lookup

    def lookup(
        self, principal: Principal, request: registry_pb2.LookupEntryRequest
    ) -> registry_pb2.LookupEntryResponse:
        return self._lookups.lookup(principal, request)

    # ------------------------------------------------------------------ operator reads / deletes

    async def get_entry(self, principal: Principal, key: registry_pb2.EntryKey) -> registry_pb2.Entry:
        return await self._entries.get_entry(principal, key)

    async def delete_entry(
        self,
        principal: Principal,
        key: registry_pb2.EntryKey,
        reason: types_pb2.RevokeReason.ValueType,
        *,
        expected_epoch: int = 0,
    ) -> registry_pb2.Entry:
        return await self._entries.delete_entry(principal, key, reason, expected_epoch=expected_epoch)

    async def list_entries(
        self, principal: Principal, request: registry_pb2.ListEntriesRequest
    ) -> registry_pb2.ListEntriesResponse:
        return await self._entries.list_entries(principal, request)
