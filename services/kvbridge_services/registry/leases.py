"""The lease checks of registrations, against the lease record the store holds (FAILED_PRECONDITION).

Pure: the callers read the records; these say whether a lease may carry the engine or entry.
"""

from __future__ import annotations

from kvbridge.errors import FailedPrecondition, Reason
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.store.base import KeyValue


def lease_gone(field: str) -> FailedPrecondition:
    return FailedPrecondition(
        Reason.LEASE_NOT_FOUND, "the lease does not exist (expired or revoked)", metadata={"field": field}
    )


def parse_lease(lease_kv: KeyValue | None, field: str) -> lease_pb2.Lease:
    if lease_kv is None:
        raise lease_gone(field)
    return lease_pb2.Lease.FromString(lease_kv.value)


def check_node_lease(lease: lease_pb2.Lease, engine_id: str) -> None:
    """An engine registers under a node lease, its own or one not bound to an engine yet."""
    if lease.kind != lease_pb2.LEASE_KIND_NODE or (lease.engine_id and lease.engine_id != engine_id):
        raise FailedPrecondition(
            Reason.LEASE_MISMATCH, "node_lease_id is not this engine's node lease", metadata={"field": "engine"}
        )


def check_entry_lease(lease: lease_pb2.Lease, entry: registry_pb2.Entry) -> None:
    key = entry.key
    mismatch = (
        lease.kind == lease_pb2.LEASE_KIND_NODE
        or lease.tenant != key.tenant
        or lease.engine_id != entry.engine_id
        or (lease.model and lease.model != key.model)
        or (lease.conversation_key and lease.conversation_key != key.conversation_key)
    )
    if mismatch:
        raise FailedPrecondition(
            Reason.LEASE_MISMATCH,
            "the lease belongs to another engine, tenant or conversation",
            metadata={"field": "entry.lease_id"},
        )
