"""Registry logic: registrations (durable, CAS on epoch, idempotent), lookups (from memory).

``Registry`` wires the parts that the servicer (``service.py``) and the app call: ``engines`` (engine records,
``engines.py``), ``registrar`` (entry registration, deciding with ``registration.py``), ``lookups`` (lookups on
the index, ``lookup.py``), ``entries`` (operator reads and deletes, ``entries.py``); ``evictions.py`` removes
entries the registry drops itself. They share one ``RegistryParts``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbridge.registry.v1 import registry_pb2
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
from .parts import RegistryParts
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
        parts = RegistryParts(store, keys, index, revoker, self.limits, store_timeout_s, clock)
        evictor = EntryEvictor(parts, max_entries_per_tenant=settings.max_entries_per_tenant)
        # The same dict the evictor counts in: the metrics read it live.
        self.evictions: dict[str, int] = evictor.evictions
        self.engines = Engines(parts, evictor, max_engines=settings.max_engines)
        self.registrar = Registrar(parts, settings, evictor, group_commit=group_commit)
        self.lookups = Lookups(parts, max_content_candidates=settings.max_content_candidates)
        self.entries = Entries(parts)

    @property
    def batcher(self) -> RegistrationBatcher[registry_pb2.RegisterEntryResponse] | None:
        return self.registrar.batcher

    async def close(self) -> None:
        """Stop group commit; registrations still queued are answered UNAVAILABLE."""
        await self.registrar.close()
        await self.engines.close()
