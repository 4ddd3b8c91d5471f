"""The in-memory index and lookups on it (no store involved)."""

from __future__ import annotations

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.hashrecord import HashRecord
from kvbridge_services.registry.index import RegistryIndex

S = b"0123456789abcdef"


def stored(conv: str, tokens: list[int], stride: int = 4, tenant: str = "acme") -> registry_pb2.Entry:
    full = hashchain.chain(S, tenant, "m", "", 4, tokens)
    rec = HashRecord.from_chain(full, stride)
    return registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant=tenant, model="m", conversation_key=conv), engine_id="d0",
        block_ids=[types_pb2.BlockIds(ids=list(range(len(tokens) // 4)))], block_size=4,
        token_count=len(tokens), block_hashes=rec.checkpoints, chain_stride=stride, final_block_hash=rec.final,
        lease_id=1, epoch=1,
    )


def test_revisions_order_updates_and_deletes() -> None:
    idx = RegistryIndex()
    idx.put_entry(stored("c", list(range(40))), 10)
    idx.put_entry(stored("c", list(range(8))), 9)  # older event arriving late: ignored
    assert idx.entries[("acme", "m", "c")].entry.token_count == 40
    idx.delete_entry(("acme", "m", "c"), 12)
    idx.put_entry(stored("c", list(range(40))), 11)  # older than the delete: no resurrection
    assert not idx.entries and idx.tenant_count("acme") == 0
    assert not idx.holders("acme", "m", stored("c", list(range(40))).final_block_hash)
    assert not idx._content  # every content hash unlinked


def test_content_index_is_per_tenant_and_cleaned_up() -> None:
    idx = RegistryIndex()
    a = stored("c", list(range(40)))
    idx.put_entry(a, 1)
    assert idx.holders("acme", "m", a.final_block_hash) == [("acme", "m", "c")]
    assert idx.holders("beta", "m", a.final_block_hash) == []
    idx.put_entry(stored("c", list(range(80))), 2)  # replaced: old hashes unlinked
    assert idx.holders("acme", "m", a.final_block_hash) == []


def test_oldest_idle_and_cap() -> None:
    idx = RegistryIndex(max_entries=3)
    for i in range(4):
        idx.put_entry(stored(f"c{i}", list(range(8))), i + 1)
    assert len(idx.entries) == 3  # hard cap: the fourth is not indexed
    idx.touch(("acme", "m", "c0"))
    victim = idx.oldest_idle("acme")
    assert victim is not None and victim.id == ("acme", "m", "c1")


def test_shared_prefix_holders_and_content_stride() -> None:
    idx = RegistryIndex(content_stride=8)
    system = list(range(4 * 16))  # 16 blocks shared
    a, b = stored("a", [*system, *range(900, 940)]), stored("b", [*system, *range(800, 820)])
    idx.put_entry(a, 1)
    idx.put_entry(b, 2)
    shared = hashchain.chain(S, "acme", "m", "", 4, system)
    assert sorted(idx.holders("acme", "m", shared[15])) == [("acme", "m", "a"), ("acme", "m", "b")]
    assert idx.holders("acme", "m", shared[11]) == []  # block 12 is a checkpoint but not a content position
    idx.delete_entry(("acme", "m", "b"), 3)
    assert idx.holders("acme", "m", shared[15]) == [("acme", "m", "a")]
