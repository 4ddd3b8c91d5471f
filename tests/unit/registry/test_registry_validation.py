from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.registry import validation as v

LIMITS = v.Limits(max_blocks_per_chain=64, max_kv_groups=2)


def good() -> registry_pb2.RegisterEntryRequest:
    return registry_pb2.RegisterEntryRequest(
        request_id="r-1",
        entry=registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant="acme", model="Qwen/Qwen3-0.6B", conversation_key="conv 1"),
            engine_id="d0",
            engine_request_id="cmpl-abc",
            block_ids=[types_pb2.BlockIds(ids=[1, 2, 3])],
            block_size=4,
            token_count=10,
            block_hashes=[b"a" * 16, b"b" * 16],
            lease_id=7,
            epoch=1,
        ),
    )


def test_good_request_passes() -> None:
    v.check_register_request(good(), LIMITS)


def _three_tokens_in_one_block(r: registry_pb2.RegisterEntryRequest) -> None:
    r.entry.token_count = 3
    del r.entry.block_ids[0].ids[-2:]


@pytest.mark.parametrize(
    ("field", "mutate", "reason"),
    [
        ("request_id", lambda r: setattr(r, "request_id", ""), "INVALID_FIELD"),
        ("request_id", lambda r: setattr(r, "request_id", "x" * 129), "INVALID_FIELD"),
        ("entry.key.tenant", lambda r: setattr(r.entry.key, "tenant", "a/b"), "INVALID_FIELD"),
        ("entry.key.model", lambda r: setattr(r.entry.key, "model", "has space"), "INVALID_FIELD"),
        ("entry.key.conversation_key", lambda r: setattr(r.entry.key, "conversation_key", "é"), "INVALID_FIELD"),
        ("entry.key.conversation_key", lambda r: setattr(r.entry.key, "conversation_key", "k" * 257), "INVALID_FIELD"),
        ("entry.engine_request_id", lambda r: setattr(r.entry, "engine_request_id", ""), "INVALID_FIELD"),
        ("entry.block_size", lambda r: setattr(r.entry, "block_size", 0), "INVALID_FIELD"),
        ("entry.token_count", lambda r: setattr(r.entry, "token_count", 0), "INVALID_FIELD"),
        ("entry.token_count", lambda r: setattr(r.entry, "token_count", 4 * 65), "TOO_LARGE"),
        ("entry.token_count", _three_tokens_in_one_block, "INVALID_FIELD"),
        ("entry.block_ids", lambda r: r.entry.ClearField("block_ids"), "INVALID_FIELD"),
        ("entry.block_ids", lambda r: r.entry.block_ids.extend([r.entry.block_ids[0]] * 2), "TOO_LARGE"),
        ("entry.block_ids[0]", lambda r: r.entry.block_ids[0].ids.pop(), "INVALID_FIELD"),
        ("entry.block_hashes", lambda r: r.entry.block_hashes.pop(), "INVALID_FIELD"),
        ("entry.block_hashes[1]", lambda r: r.entry.block_hashes.__setitem__(1, b"x" * 17), "INVALID_FIELD"),
        ("entry.chain_stride", lambda r: setattr(r.entry, "chain_stride", 4), "INVALID_FIELD"),
        ("entry.tail_block_hashes", lambda r: setattr(r.entry, "tail_block_hashes", b"t" * 16), "INVALID_FIELD"),
        ("entry.tail_start_block", lambda r: setattr(r.entry, "tail_start_block", 4), "INVALID_FIELD"),
        ("entry.final_block_hash", lambda r: setattr(r.entry, "final_block_hash", b"z" * 16), "INVALID_FIELD"),
        ("entry.lease_id", lambda r: setattr(r.entry, "lease_id", 0), "INVALID_FIELD"),
        ("entry.epoch", lambda r: setattr(r.entry, "epoch", 0), "INVALID_FIELD"),
        ("entry", lambda r: r.ClearField("entry"), "INVALID_FIELD"),
    ],
)
def test_each_bad_field_is_named(
    field: str, mutate: Callable[[registry_pb2.RegisterEntryRequest], object], reason: str
) -> None:
    req = good()
    mutate(req)
    with pytest.raises(InvalidArgument) as info:
        v.check_register_request(req, LIMITS)
    assert (info.value.reason, info.value.metadata["field"]) == (reason, field)


def test_lookup_and_engine_validation() -> None:
    ok = registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes=[b"h" * 16])
    v.check_lookup_request(ok, LIMITS)
    with pytest.raises(InvalidArgument) as info:
        v.check_lookup_request(
            registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes=[b"h" * 16] * 65), LIMITS
        )
    assert info.value.reason == "TOO_LARGE"
    engine = types_pb2.Engine(
        engine_id="d0",
        role=types_pb2.ENGINE_ROLE_DECODE,
        model="m",
        kv_host="10.0.0.1",
        kv_port=5600,
        block_size=16,
        kv_group_count=1,
        node_lease_id=3,
    )
    v.check_engine(engine, LIMITS)
    for field, value in [("kv_port", 0), ("kv_host", "bad host"), ("node_lease_id", 0), ("kv_group_count", 3)]:
        bad = types_pb2.Engine()
        bad.CopyFrom(engine)
        setattr(bad, field, value)
        with pytest.raises(InvalidArgument) as info:
            v.check_engine(bad, LIMITS)
        assert info.value.metadata["field"] == f"engine.{field}"


@pytest.mark.parametrize(
    ("packed", "repeated", "reason"),
    [
        (b"h" * 17, [], "INVALID_FIELD"),  # not a multiple of the hash size
        (b"h" * 16, [b"h" * 16], "INVALID_FIELD"),  # both forms set
        (b"h" * 16 * 65, [], "TOO_LARGE"),  # past max_blocks_per_chain
    ],
)
def test_packed_lookup_chain_validation(packed: bytes, repeated: list[bytes], reason: str) -> None:
    req = registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes=repeated, block_hashes_packed=packed)
    with pytest.raises(InvalidArgument) as info:
        v.check_lookup_request(req, LIMITS)
    assert (info.value.reason, info.value.metadata["field"]) == (reason, "block_hashes_packed")


def test_packed_and_repeated_lookup_chains_read_the_same() -> None:
    hashes = [bytes([i]) * 16 for i in range(64)]
    packed = v.check_lookup_request(
        registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes_packed=b"".join(hashes)), LIMITS
    )
    repeated = v.check_lookup_request(
        registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes=hashes), LIMITS
    )
    assert len(packed) == len(repeated) == 64
    assert list(packed) == list(repeated) == hashes
    assert packed[-1] == hashes[-1] and list(packed[3:9:2]) == hashes[3:9:2]
    with pytest.raises(IndexError):
        packed[64]


def test_a_bad_hash_in_the_repeated_form_is_named_by_index() -> None:
    req = registry_pb2.LookupEntryRequest(model="m", block_size=16, block_hashes=[b"h" * 16, b"h" * 16, b"x"])
    with pytest.raises(InvalidArgument) as info:
        v.check_lookup_request(req, LIMITS)
    assert info.value.metadata["field"] == "block_hashes[2]"
