"""One registration decided from one snapshot: replay, error, or the write (and whether it needs room)."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from kvbridge.errors import FailedPrecondition, InvalidArgument, KvbridgeError, Reason
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.base import KeyValue
from kvbridge_services.registry.records import compact, now_ts, request_record
from kvbridge_services.registry.registration import Registration, Replay, Write, decide

REQUEST, ENTRY, LEASE, ENGINE = b"request", b"entry", b"lease", b"engine"
INCARNATION = 100


def engine(**fields: object) -> types_pb2.Engine:
    record = types_pb2.Engine(engine_id="d0", model="m", block_size=4, kv_group_count=1, node_lease_id=INCARNATION)
    for name, value in fields.items():
        setattr(record, name, value)
    return record


LEASE_RECORD = lease_pb2.Lease(
    lease_id=7, kind=lease_pb2.LEASE_KIND_ENTRY, tenant="acme", engine_id="d0", model="m", conversation_key="c"
)


def registration(epoch: int = 1, *, asserted: int = 0, tokens: int = 40, at: float = 10.0) -> Registration:
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(model="m", conversation_key="c"),
        engine_id="d0",
        block_ids=[types_pb2.BlockIds(ids=list(range(tokens // 4)))],
        block_size=4,
        token_count=tokens,
        block_hashes=[bytes([i]) * 16 for i in range(tokens // 4)],
        lease_id=7,
        epoch=epoch,
    )
    stored, digest = compact(entry, "acme", stride=4, exact_tail_blocks=0, register_time=now_ts(lambda: at))
    return Registration("r-1", stored, digest, ENTRY, REQUEST, LEASE, ENGINE, asserted_incarnation=asserted)


def kv(key: bytes, message: Message | bytes, mod_revision: int = 5) -> KeyValue:
    value = message if isinstance(message, bytes) else message.SerializeToString()
    return KeyValue(key, value, 1, mod_revision, 1, lease=42)


def stored_entry(epoch: int, *, incarnation: int = INCARNATION, tokens: int = 40, at: float = 5.0) -> KeyValue:
    """What an earlier registration left in the store."""
    entry = registration(epoch, tokens=tokens, at=at).entry
    entry.engine_incarnation = incarnation
    return kv(ENTRY, entry)


LEASE_KV = kv(LEASE, LEASE_RECORD)
ENGINE_KV = kv(ENGINE, engine())


def snapshot(
    *,
    record: KeyValue | None = None,
    current: KeyValue | None = None,
    lease: KeyValue | None = LEASE_KV,
    engine_kv: KeyValue | None = ENGINE_KV,
) -> dict[bytes, KeyValue | None]:
    return {REQUEST: record, ENTRY: current, LEASE: lease, ENGINE: engine_kv}


def refused(reg: Registration, reads: dict[bytes, KeyValue | None]) -> KvbridgeError:
    with pytest.raises(KvbridgeError) as err:
        decide(reg, reads)
    return err.value


def test_a_new_conversation_is_written_bound_to_the_registered_incarnation_and_needs_room() -> None:
    reg = registration(asserted=INCARNATION)
    assert decide(reg, snapshot()) == Write(INCARNATION, None, needs_room=True)
    assert reg.entry.engine_incarnation == 0  # deciding writes nothing, not even into the entry


def test_a_seen_request_id_replays_its_recorded_answer_before_any_other_check() -> None:
    reg = registration()
    answer = registry_pb2.RegisterEntryResponse(entry=reg.entry, superseded_epoch=1)
    # The engine and lease are gone since: the retry still gets the answer the first try got.
    decision = decide(reg, snapshot(record=kv(REQUEST, request_record(reg.digest, answer)), lease=None, engine_kv=None))
    assert isinstance(decision, Replay)
    assert decision.response.replayed and decision.response.superseded_epoch == 1


def test_a_request_id_used_for_another_registration_conflicts() -> None:
    first = registration(tokens=36)
    record = kv(REQUEST, request_record(first.digest, registry_pb2.RegisterEntryResponse(entry=first.entry)))
    assert refused(registration(), snapshot(record=record)).reason == Reason.IDEMPOTENCY_CONFLICT


def test_an_unregistered_engine_is_engine_not_found() -> None:
    err = refused(registration(), snapshot(engine_kv=None))
    assert isinstance(err, FailedPrecondition) and err.reason == Reason.ENGINE_NOT_FOUND


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"model": "other"}, "entry.key.model"),
        ({"block_size": 8}, "entry.block_size"),
        ({"kv_group_count": 2}, "entry.block_ids"),
    ],
)
def test_an_entry_the_engine_could_not_have_made_is_an_invalid_field(fields: dict[str, object], field: str) -> None:
    err = refused(registration(), snapshot(engine_kv=kv(ENGINE, engine(**fields))))
    assert isinstance(err, InvalidArgument) and err.metadata["field"] == field


def test_blocks_retained_by_a_previous_incarnation_are_engine_restarted() -> None:
    err = refused(registration(asserted=INCARNATION - 1), snapshot())
    assert err.reason == Reason.ENGINE_RESTARTED
    assert err.metadata == {"field": "entry.engine_incarnation", "engine_incarnation": str(INCARNATION)}


def test_the_entry_lease_is_checked() -> None:
    assert refused(registration(), snapshot(lease=None)).reason == Reason.LEASE_NOT_FOUND
    other = lease_pb2.Lease()
    other.CopyFrom(LEASE_RECORD)
    other.conversation_key = "other"
    assert refused(registration(), snapshot(lease=kv(LEASE, other))).reason == Reason.LEASE_MISMATCH


def test_a_new_epoch_supersedes_the_live_entry_without_needing_room() -> None:
    decision = decide(registration(2), snapshot(current=stored_entry(1)))
    assert isinstance(decision, Write) and not decision.needs_room
    assert decision.current is not None and decision.current.epoch == 1


@pytest.mark.parametrize(("stored_epoch", "tokens"), [(3, 40), (2, 36)])
def test_a_higher_or_same_epoch_with_other_content_is_stale(stored_epoch: int, tokens: int) -> None:
    err = refused(registration(2), snapshot(current=stored_entry(stored_epoch, tokens=tokens)))
    assert err.reason == Reason.STALE_EPOCH
    assert err.metadata == {"field": "entry.epoch", "stored_epoch": str(stored_epoch)}


def test_the_same_registration_under_another_request_id_replays_the_stored_entry() -> None:
    current = stored_entry(2, at=5.0)  # registered earlier: another register_time, the incarnation bound
    decision = decide(registration(2, at=10.0), snapshot(current=current))
    assert decision == Replay(
        registry_pb2.RegisterEntryResponse(entry=registry_pb2.Entry.FromString(current.value), replayed=True)
    )


def test_a_previous_incarnations_entry_is_replaced_whatever_its_epoch() -> None:
    decision = decide(registration(1), snapshot(current=stored_entry(9, incarnation=INCARNATION - 1)))
    assert isinstance(decision, Write) and decision.needs_room
    assert decision.current is not None and decision.current.epoch == 9


def test_another_engines_entry_keeps_its_epoch_rule() -> None:
    other = registration(9).entry
    other.engine_id, other.engine_incarnation = "d1", 1
    assert refused(registration(1), snapshot(current=kv(ENTRY, other))).reason == Reason.STALE_EPOCH
