"""What the registry writes: the compact entry, its content digest, the idempotency record."""

from __future__ import annotations

import pytest
from google.protobuf import timestamp_pb2

from kvbridge import hashchain
from kvbridge.errors import FailedPrecondition, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.entrylookup import record_of
from kvbridge_services.registry.records import compact, content_digest, now_ts, replay_of, request_record

S = b"0123456789abcdef"
TOKENS = list(range(40))  # ten blocks of 4


def request_entry(tokens: list[int] = TOKENS) -> registry_pb2.Entry:
    return registry_pb2.Entry(
        key=registry_pb2.EntryKey(model="m", conversation_key="c"),
        engine_id="d0",
        block_ids=[types_pb2.BlockIds(ids=list(range(len(tokens) // 4)))],
        block_size=4,
        token_count=len(tokens),
        block_hashes=hashchain.chain(S, "acme", "m", "", 4, tokens),
        lease_id=7,
        epoch=1,
        engine_incarnation=99,  # what a caller says; the registry binds its own
    )


def at(seconds: float) -> timestamp_pb2.Timestamp:
    return now_ts(lambda: seconds)


def test_now_ts_keeps_the_fraction_of_a_second() -> None:
    ts = at(1.5)
    assert (ts.seconds, ts.nanos) == (1, 500_000_000)


def test_compact_stores_checkpoints_that_still_verify_the_whole_chain() -> None:
    request = request_entry()
    stored, _ = compact(request, "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    full = list(request.block_hashes)
    assert list(stored.block_hashes) == [full[3], full[7]]  # every 4th block
    assert stored.final_block_hash == full[-1] and stored.chain_stride == 4
    assert record_of(stored).verified_blocks(full) == 10
    assert record_of(stored).verified_blocks(full[:6]) == 4  # up to the last checkpoint the prompt reaches
    assert list(request.block_hashes) == full  # the request is left as it came


def test_compact_sets_the_tenant_and_server_fields() -> None:
    stored, _ = compact(request_entry(), "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    assert stored.key.tenant == "acme"
    assert stored.engine_incarnation == 0  # set from the registry's engine record, never from the caller
    assert stored.register_time.seconds == 10


def test_the_digest_ignores_server_set_fields_but_not_content() -> None:
    stored, digest = compact(request_entry(), "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    assert content_digest(stored) == digest
    stored.engine_incarnation = 5  # what the registrar binds before writing
    assert content_digest(stored) == digest
    _, again_digest = compact(request_entry(), "acme", stride=4, exact_tail_blocks=0, register_time=at(20))
    assert again_digest == digest
    _, other_digest = compact(request_entry(TOKENS[:36]), "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    assert other_digest != digest
    _, other_tenant = compact(request_entry(), "beta", stride=4, exact_tail_blocks=0, register_time=at(10))
    assert other_tenant != digest


def test_a_recorded_response_replays_for_the_same_registration() -> None:
    stored, digest = compact(request_entry(), "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    response = registry_pb2.RegisterEntryResponse(entry=stored, superseded_epoch=3)
    replayed = replay_of(request_record(digest, response), digest, "r-1")
    assert replayed.replayed
    assert replayed.entry == stored and replayed.superseded_epoch == 3


@pytest.mark.parametrize("damage", ["other digest", "other version"])
def test_a_request_id_reused_for_another_registration_conflicts(damage: str) -> None:
    stored, digest = compact(request_entry(), "acme", stride=4, exact_tail_blocks=0, register_time=at(10))
    record = request_record(digest, registry_pb2.RegisterEntryResponse(entry=stored))
    if damage == "other version":
        record = b"\x02" + record[1:]
    asked = bytes(32) if damage == "other digest" else digest
    with pytest.raises(FailedPrecondition) as err:
        replay_of(record, asked, "r-1")
    assert err.value.reason == Reason.IDEMPOTENCY_CONFLICT
    assert err.value.metadata == {"field": "request_id"}
