"""What the registry writes for a registration: the compact entry, its content digest, and the idempotency
record that answers a retry of the same request id. Pure (the clock's reading is passed in)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from google.protobuf import timestamp_pb2

from kvbridge.errors import FailedPrecondition, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.hashrecord import HashRecord

# First byte of an idempotency record: version, then the registration's 32-byte digest, then the response.
RECORD_VERSION = b"\x01"
_DIGEST_END = 1 + hashlib.sha256().digest_size


def now_ts(clock: Callable[[], float]) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(clock() * 1e9))
    return ts


def write_record(stored: registry_pb2.Entry, record: HashRecord) -> None:
    """Replaces ``stored``'s whole chain with the compact record the registry persists."""
    del stored.block_hashes[:]
    stored.block_hashes.extend(record.checkpoints)
    stored.chain_stride = record.stride
    stored.final_block_hash = record.final
    stored.tail_block_hashes = record.packed_tail()
    stored.tail_start_block = record.tail_start


def digest_of(entry: registry_pb2.Entry) -> bytes:
    return hashlib.sha256(entry.SerializeToString(deterministic=True)).digest()


def content_digest(entry: registry_pb2.Entry) -> bytes:
    """Digest of what a registration stores, ignoring the server-set register_time and engine_incarnation."""
    if not entry.HasField("register_time") and not entry.engine_incarnation:
        return digest_of(entry)
    copy = registry_pb2.Entry()
    copy.CopyFrom(entry)
    copy.ClearField("register_time")
    copy.ClearField("engine_incarnation")
    return digest_of(copy)


def compact(
    entry: registry_pb2.Entry,
    tenant: str,
    *,
    stride: int,
    exact_tail_blocks: int,
    register_time: timestamp_pb2.Timestamp,
) -> tuple[registry_pb2.Entry, bytes]:
    """The entry as stored (every stride-th hash, the tail's every hash, server time) and its content
    digest."""
    record = HashRecord.from_chain(entry.block_hashes, stride, exact_tail_blocks)
    stored = registry_pb2.Entry()
    stored.CopyFrom(entry)
    stored.key.tenant = tenant
    write_record(stored, record)
    stored.ClearField("engine_incarnation")  # the registry sets it from its engine record
    digest = digest_of(stored)  # before register_time is set: same as content_digest, without a copy
    stored.register_time.CopyFrom(register_time)
    return stored, digest


def request_record(digest: bytes, response: registry_pb2.RegisterEntryResponse) -> bytes:
    """The idempotency record of a committed registration: its digest and the answer a retry gets."""
    return RECORD_VERSION + digest + response.SerializeToString()


def replay_of(record: bytes, digest: bytes, request_id: str) -> registry_pb2.RegisterEntryResponse:
    """The answer to a request id seen before: the recorded response, marked replayed, if the registration
    is the same (``digest``); IDEMPOTENCY_CONFLICT if the id was used for another one."""
    if record[:1] != RECORD_VERSION or record[1:_DIGEST_END] != digest:
        raise FailedPrecondition(
            Reason.IDEMPOTENCY_CONFLICT,
            f"request id {request_id!r} was used for a different registration",
            metadata={"field": "request_id"},
        )
    response = registry_pb2.RegisterEntryResponse.FromString(record[_DIGEST_END:])
    response.replayed = True
    return response
