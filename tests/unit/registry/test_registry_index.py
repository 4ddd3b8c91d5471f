"""The in-memory index and lookups on it (no store involved)."""

from __future__ import annotations

import pytest

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.hashrecord import HashRecord
from kvbridge_services.registry import index
from kvbridge_services.registry.index import RegistryIndex

S = b"0123456789abcdef"


def stored(conv: str, tokens: list[int], stride: int = 4, tenant: str = "acme") -> registry_pb2.Entry:
    full = hashchain.chain(S, tenant, "m", "", 4, tokens)
    rec = HashRecord.from_chain(full, stride)
    return registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant=tenant, model="m", conversation_key=conv),
        engine_id="d0",
        block_ids=[types_pb2.BlockIds(ids=list(range(len(tokens) // 4)))],
        block_size=4,
        token_count=len(tokens),
        block_hashes=rec.checkpoints,
        chain_stride=stride,
        final_block_hash=rec.final,
        lease_id=1,
        epoch=1,
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


def test_deletions_are_remembered_first_in_first_out_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "MAX_TOMBSTONES", 2)
    idx = RegistryIndex()
    for rev, conv in enumerate(("a", "b", "c"), start=10):
        idx.delete_entry(("acme", "m", conv), rev)
    idx.delete_entry(("acme", "m", "b"), 20)  # deleted again: now the newest, "c" the oldest remembered
    idx.delete_entry(("acme", "m", "d"), 21)  # over the cap: "c" is forgotten, "b" kept
    for conv in ("b", "c", "d"):
        idx.put_entry(stored(conv, list(range(8))), 5)  # late events older than every deletion
    assert sorted(eid[2] for eid in idx.entries) == ["c"]  # only the forgotten deletion lets one back


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


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_fresh_only_within_the_lag_bound_since_the_store_last_answered() -> None:
    clock = _Clock()
    idx = RegistryIndex(max_lag_s=2.0, clock=clock)
    assert not idx.fresh() and idx.lag_s() == float("inf")  # never heard from the store
    idx.heard()
    clock.now += 2.0
    assert idx.fresh() and idx.lag_s() == 2.0
    clock.now += 0.5
    assert not idx.fresh() and idx.lag_s() == 2.5
    idx.heard()
    assert idx.fresh() and idx.lag_s() == 0.0


def test_entries_of_other_incarnations_of_an_engine() -> None:
    idx = RegistryIndex()
    old, new, other = stored("a", list(range(8))), stored("b", list(range(8))), stored("c", list(range(8)))
    old.engine_incarnation, new.engine_incarnation = 7, 9
    other.engine_id, other.engine_incarnation = "d1", 3
    for rev, e in enumerate((old, new, other), start=1):
        idx.put_entry(e, rev)
    engine = types_pb2.Engine(engine_id="d0", node_lease_id=9)
    assert [i.id for i in idx.of_other_incarnations(engine)] == [("acme", "m", "a")]
    idx.delete_entry(("acme", "m", "a"), 10)
    assert idx.of_other_incarnations(engine) == []
    moved = stored("b", list(range(12)))  # the conversation now lives on d1
    moved.engine_id, moved.engine_incarnation = "d1", 1
    idx.put_entry(moved, 11)
    assert idx.of_other_incarnations(types_pb2.Engine(engine_id="d0", node_lease_id=1)) == []
    assert [i.id for i in idx.of_other_incarnations(types_pb2.Engine(engine_id="d1", node_lease_id=3))] == [
        ("acme", "m", "b")
    ]
    idx.clear()
    assert idx.of_other_incarnations(types_pb2.Engine(engine_id="d1", node_lease_id=99)) == []


def test_engines_with_entries_of_another_incarnation_are_suspects() -> None:
    idx = RegistryIndex()
    idx.put_engine(types_pb2.Engine(engine_id="d0", node_lease_id=7), 1)
    current = stored("a", list(range(8)))
    current.engine_incarnation = 7
    idx.put_entry(current, 2)
    assert idx.suspect_engines == set()  # every entry is of the engine's incarnation
    idx.put_engine(types_pb2.Engine(engine_id="d0", node_lease_id=9), 3)  # a new process
    assert idx.suspect_engines == {"d0"}
    idx.suspect_engines.clear()
    late = stored("b", list(range(8)))
    late.engine_incarnation = 7  # an old incarnation's entry arriving after the engine's re-registration
    idx.put_entry(late, 4)
    assert idx.suspect_engines == {"d0"}
    idx.put_engine(types_pb2.Engine(engine_id="d1", node_lease_id=1), 5)
    idx.put_engine(types_pb2.Engine(engine_id="d1", node_lease_id=2), 6)  # no entries: nothing to drop
    assert idx.suspect_engines == {"d0"}
