"""The lease checks of registrations: a lease that is gone, a node lease for an engine, an entry's lease."""

from __future__ import annotations

import pytest

from kvbridge.errors import FailedPrecondition, Reason
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.common.store.base import KeyValue
from kvbridge_services.registry.leases import check_entry_lease, check_node_lease, parse_lease

ENTRY = registry_pb2.Entry(
    key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key="c"), engine_id="d0", lease_id=7
)


def entry_lease(**fields: object) -> lease_pb2.Lease:
    lease = lease_pb2.Lease(
        lease_id=7, kind=lease_pb2.LEASE_KIND_ENTRY, tenant="acme", engine_id="d0", model="m", conversation_key="c"
    )
    for name, value in fields.items():
        setattr(lease, name, value)
    return lease


def test_a_missing_lease_record_is_lease_not_found_on_the_callers_field() -> None:
    with pytest.raises(FailedPrecondition) as err:
        parse_lease(None, "entry.lease_id")
    assert err.value.reason == Reason.LEASE_NOT_FOUND
    assert err.value.metadata == {"field": "entry.lease_id"}


def test_a_lease_record_is_parsed() -> None:
    lease = entry_lease()
    assert parse_lease(KeyValue(b"k", lease.SerializeToString(), 1, 1, 1), "f") == lease


@pytest.mark.parametrize("bound_to", ["", "d0"])
def test_an_engine_registers_under_its_own_or_an_unbound_node_lease(bound_to: str) -> None:
    check_node_lease(lease_pb2.Lease(kind=lease_pb2.LEASE_KIND_NODE, engine_id=bound_to), "d0")


@pytest.mark.parametrize(
    "lease",
    [
        lease_pb2.Lease(kind=lease_pb2.LEASE_KIND_NODE, engine_id="d1"),  # another engine's
        lease_pb2.Lease(kind=lease_pb2.LEASE_KIND_ENTRY, engine_id="d0"),  # not a node lease
    ],
)
def test_an_engine_cannot_register_under_another_lease(lease: lease_pb2.Lease) -> None:
    with pytest.raises(FailedPrecondition) as err:
        check_node_lease(lease, "d0")
    assert err.value.reason == Reason.LEASE_MISMATCH


@pytest.mark.parametrize("fields", [{}, {"model": ""}, {"conversation_key": ""}, {"model": "", "conversation_key": ""}])
def test_an_entry_lease_matches_its_entry_and_may_leave_model_and_conversation_open(fields: dict[str, object]) -> None:
    check_entry_lease(entry_lease(**fields), ENTRY)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": lease_pb2.LEASE_KIND_NODE},
        {"tenant": "other"},
        {"engine_id": "d1"},
        {"model": "other"},
        {"conversation_key": "other"},
    ],
)
def test_an_entry_lease_of_another_kind_tenant_engine_model_or_conversation_is_refused(
    fields: dict[str, object],
) -> None:
    with pytest.raises(FailedPrecondition) as err:
        check_entry_lease(entry_lease(**fields), ENTRY)
    assert err.value.reason == Reason.LEASE_MISMATCH
    assert err.value.metadata == {"field": "entry.lease_id"}
