"""What one registration does, decided from one snapshot of the store. Pure: the registrar (``registrar.py``)
reads the request's idempotency record, the conversation's entry, the entry's lease and its engine's record
in one txn or group-commit round; ``decide`` answers a replay, raises the RPC error, or says what to write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvbridge.errors import FailedPrecondition, Reason, invalid_field
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.store.base import KeyValue

from .leases import check_entry_lease, parse_lease
from .records import content_digest, replay_of


@dataclass(frozen=True, slots=True)
class Registration:
    """A validated registration: the compacted entry and the store keys it reads and writes."""

    request_id: str
    entry: registry_pb2.Entry
    digest: bytes
    entry_key: bytes
    request_key: bytes
    lease_key: bytes
    engine_key: bytes
    # The engine incarnation the caller registers for (0: whichever is registered now).
    asserted_incarnation: int = 0
    # The conversation's close tombstone (b"": not checked): a close refuses registrations up to its epoch.
    closed_key: bytes = b""

    @property
    def read_keys(self) -> tuple[bytes, ...]:
        keys = (self.request_key, self.entry_key, self.lease_key, self.engine_key)
        return (*keys, self.closed_key) if self.closed_key else keys


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer without writing: the request id was seen before, or the same registration is stored already."""

    response: registry_pb2.RegisterEntryResponse


@dataclass(frozen=True, slots=True)
class Write:
    """Write the entry, bound to engine ``incarnation``, over ``current`` (None: the conversation has none)."""

    incarnation: int
    current: registry_pb2.Entry | None
    # The tenant cap is enforced before the write: always, except for a new epoch over a live entry of the
    # same engine incarnation.
    needs_room: bool


def check_engine(engine_kv: KeyValue | None, entry: registry_pb2.Entry) -> types_pb2.Engine:
    if engine_kv is None:
        raise FailedPrecondition(
            Reason.ENGINE_NOT_FOUND,
            f"engine {entry.engine_id!r} is not registered and live",
            metadata={"field": "entry.engine_id"},
        )
    engine = types_pb2.Engine.FromString(engine_kv.value)
    if engine.model != entry.key.model:
        raise invalid_field("entry.key.model", f"engine {entry.engine_id!r} serves {engine.model!r}")
    if engine.block_size != entry.block_size:
        raise invalid_field("entry.block_size", f"engine {entry.engine_id!r} uses block size {engine.block_size}")
    if engine.kv_group_count and len(entry.block_ids) != engine.kv_group_count:
        raise invalid_field("entry.block_ids", f"engine {entry.engine_id!r} has {engine.kv_group_count} KV groups")
    return engine


def check_incarnation(engine_id: str, asserted: int, engine: types_pb2.Engine) -> None:
    """The blocks were retained by the incarnation ``asserted`` (0: not said) of ``engine``, the record now
    registered under ``engine_id``; ENGINE_RESTARTED if it registered again since."""
    if asserted and asserted != engine.node_lease_id:
        raise FailedPrecondition(
            Reason.ENGINE_RESTARTED,
            f"engine {engine_id!r} registered again (incarnation {engine.node_lease_id}) since these "
            f"blocks were retained (incarnation {asserted})",
            metadata={"field": "entry.engine_incarnation", "engine_incarnation": str(engine.node_lease_id)},
        )


def closed_epoch(tombstone: KeyValue | None) -> int:
    """The epoch a conversation was closed at (0: no tombstone)."""
    if tombstone is None:
        return 0
    try:
        return int(tombstone.value)
    except ValueError:
        return 0


def check_not_closed(tombstone: KeyValue | None, entry: registry_pb2.Entry) -> None:
    """A close wins over a registration racing it: an entry of an epoch up to the close is refused (issue 30)."""
    closed = closed_epoch(tombstone)
    if closed and entry.epoch <= closed:
        raise FailedPrecondition(
            Reason.STALE_EPOCH,
            f"the conversation was closed at epoch {closed}, after this turn (epoch {entry.epoch}) began",
            metadata={"field": "entry.epoch", "closed_epoch": str(closed)},
        )


def decide(reg: Registration, reads: Mapping[bytes, KeyValue | None]) -> Replay | Write:
    """From one snapshot: the answer (replay), the error (raised), or the write to commit."""
    entry = reg.entry
    record_kv, current_kv = reads[reg.request_key], reads[reg.entry_key]
    if record_kv is not None:
        return Replay(replay_of(record_kv.value, reg.digest, reg.request_id))
    engine = check_engine(reads[reg.engine_key], entry)
    check_incarnation(entry.engine_id, reg.asserted_incarnation, engine)
    # Bound to the incarnation the registry knows, never to what a caller says (docs/adr/0010).
    incarnation = engine.node_lease_id
    check_entry_lease(parse_lease(reads[reg.lease_key], "entry.lease_id"), entry)
    check_not_closed(reads.get(reg.closed_key) if reg.closed_key else None, entry)
    current = registry_pb2.Entry.FromString(current_kv.value) if current_kv is not None else None
    # An entry of a previous incarnation of the same engine is garbage whatever its epoch: replace it.
    if current is None or (current.engine_id == entry.engine_id and current.engine_incarnation != incarnation):
        return Write(incarnation, current, needs_room=True)
    if current.epoch > entry.epoch or (current.epoch == entry.epoch and content_digest(current) != reg.digest):
        raise FailedPrecondition(
            Reason.STALE_EPOCH,
            f"stored epoch {current.epoch} supersedes epoch {entry.epoch}",
            metadata={"field": "entry.epoch", "stored_epoch": str(current.epoch)},
        )
    if current.epoch == entry.epoch:  # the same registration again (request id differs)
        return Replay(registry_pb2.RegisterEntryResponse(entry=current, replayed=True))
    return Write(incarnation, current, needs_room=False)
