"""Operator reads and deletes of entries, on the in-process MemoryStore: pages bound to their filters,
filtered pages that come back short, deletes at an expected epoch."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from kvbridge.errors import FailedPrecondition, InvalidArgument, NotFound, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import DEV_PRINCIPAL
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.entries import Entries
from kvbridge_services.registry.index import RegistryIndex
from kvbridge_services.registry.parts import RegistryParts
from kvbridge_services.registry.releaser import BackgroundRevoker, LogOnlyReleaser
from kvbridge_services.registry.validation import Limits

KEYS = KeyLayout()


def entry(conv: str, engine_id: str = "d0", epoch: int = 1) -> registry_pb2.Entry:
    return registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key=conv),
        engine_id=engine_id,
        lease_id=7,
        epoch=epoch,
    )


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    store = MemoryStore()
    try:
        yield store
    finally:
        await store.close()


async def entries_over(store: MemoryStore, *stored: registry_pb2.Entry) -> Entries:
    for e in stored:
        await store.put(KEYS.entry(e.key.tenant, e.key.model, e.key.conversation_key), e.SerializeToString())
    revoker = BackgroundRevoker(LogOnlyReleaser())
    return Entries(RegistryParts(store, KEYS, RegistryIndex(), revoker, Limits(), 5.0, time.time))


def convs(response: registry_pb2.ListEntriesResponse) -> list[str]:
    return [e.key.conversation_key for e in response.entries]


async def test_a_page_token_is_bound_to_the_engine_filter(store: MemoryStore) -> None:
    entries = await entries_over(store, *(entry(f"c{i}", engine_id="d0" if i % 2 else "d1") for i in range(6)))
    first = await entries.list_entries(DEV_PRINCIPAL, registry_pb2.ListEntriesRequest(tenant="acme", page_size=2))
    assert convs(first) == ["c0", "c1"] and first.next_page_token
    with pytest.raises(InvalidArgument) as err:
        await entries.list_entries(
            DEV_PRINCIPAL,
            registry_pb2.ListEntriesRequest(tenant="acme", engine_id="d0", page_token=first.next_page_token),
        )
    assert err.value.reason == Reason.INVALID_PAGE_TOKEN


async def test_a_filtered_list_goes_on_past_short_pages_until_the_end(store: MemoryStore) -> None:
    # Every tenth entry is d1's: a page scans a bounded number of store pages, so some come back empty.
    entries = await entries_over(
        store, *(entry(f"c{i:02}", engine_id="d1" if i % 10 == 0 else "d0") for i in range(40))
    )
    found: list[str] = []
    empty_pages = 0
    token = ""
    while True:
        page = await entries.list_entries(
            DEV_PRINCIPAL, registry_pb2.ListEntriesRequest(tenant="acme", engine_id="d1", page_size=1, page_token=token)
        )
        found += convs(page)
        assert len(page.entries) <= 1
        token = page.next_page_token
        empty_pages += not page.entries and bool(token)
        if not token:
            break
    assert found == ["c00", "c10", "c20", "c30"]
    assert empty_pages  # short pages carried a token to go on


async def test_a_delete_at_another_epoch_is_refused_and_leaves_the_entry(store: MemoryStore) -> None:
    entries = await entries_over(store, entry("c", epoch=3))
    key = registry_pb2.EntryKey(tenant="acme", model="m", conversation_key="c")
    with pytest.raises(FailedPrecondition) as err:
        await entries.delete_entry(DEV_PRINCIPAL, key, types_pb2.REVOKE_REASON_OPERATOR, expected_epoch=2)
    assert err.value.reason == Reason.STALE_EPOCH and err.value.metadata["stored_epoch"] == "3"
    assert (await entries.get_entry(DEV_PRINCIPAL, key)).epoch == 3
    deleted = await entries.delete_entry(DEV_PRINCIPAL, key, types_pb2.REVOKE_REASON_OPERATOR, expected_epoch=3)
    assert deleted.epoch == 3
    with pytest.raises(NotFound):
        await entries.get_entry(DEV_PRINCIPAL, key)
