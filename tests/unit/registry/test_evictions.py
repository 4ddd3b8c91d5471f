"""The per-tenant cap (registry/evictions.py) on the in-process MemoryStore: a new key makes room by evicting the
oldest-idle entry; a write that replaces the entry under its own key (a previous incarnation's) evicts nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.evictions import EVICTED_TENANT_CAP, EntryEvictor
from kvbridge_services.registry.index import RegistryIndex
from kvbridge_services.registry.parts import RegistryParts
from kvbridge_services.registry.releaser import BackgroundRevoker, LogOnlyReleaser
from kvbridge_services.registry.validation import Limits

KEYS = KeyLayout()
CAP = 2


@pytest.fixture
async def evictor() -> AsyncIterator[EntryEvictor]:
    store = MemoryStore()
    index = RegistryIndex()
    for conv in ("c0", "c1"):  # the tenant at its cap; c0 the oldest idle
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key=conv),
            engine_id="d0",
            lease_id=7,
            block_size=16,
            token_count=16,
            final_block_hash=bytes(16),
        )
        revision = await store.put(KEYS.entry("acme", "m", conv), entry.SerializeToString())
        index.put_entry(entry, revision)
    parts = RegistryParts(store, KEYS, index, BackgroundRevoker(LogOnlyReleaser()), Limits(), 5.0, time.time)
    try:
        yield EntryEvictor(parts, max_entries_per_tenant=CAP)
    finally:
        await store.close()


def indexed(evictor: EntryEvictor) -> list[str]:
    return sorted(eid[2] for eid in evictor._parts.index.entries)


async def test_a_new_key_at_the_cap_evicts_the_oldest_idle_entry(evictor: EntryEvictor) -> None:
    await evictor.make_room("acme", ("acme", "m", "c2"))
    assert indexed(evictor) == ["c1"] and evictor.evictions == {EVICTED_TENANT_CAP: 1}


async def test_replacing_the_entry_under_its_own_key_evicts_nothing(evictor: EntryEvictor) -> None:
    # A restarted engine registering c1 again: its write replaces c1, the tenant stays at 2 entries.
    await evictor.make_room("acme", ("acme", "m", "c1"))
    assert indexed(evictor) == ["c0", "c1"] and evictor.evictions == {}
