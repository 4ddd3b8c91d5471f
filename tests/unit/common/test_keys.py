"""The etcd key layout: round trips, and user-chosen components cannot escape their level."""

from __future__ import annotations

import pytest

from kvbridge_services.common.keys import KeyLayout

LAYOUT = KeyLayout("/kvbridge/v1")


@pytest.mark.parametrize(
    ("tenant", "model", "conv"),
    [("t1", "llama", "c1"), ("a/b", "m/../x", "c/d/e"), ("%2F", "ü-model", "sp ace"), ("t", "m", "")],
)
def test_entry_round_trip(tenant: str, model: str, conv: str) -> None:
    key = LAYOUT.entry(tenant, model, conv)
    assert LAYOUT.parse_entry(key) == (tenant, model, conv)
    assert key.startswith(LAYOUT.entries_prefix(tenant, model))


def test_slash_in_component_cannot_escape_prefix() -> None:
    # Tenant "a/b" must not fall under tenant "a"'s prefix, nor vice versa.
    assert not LAYOUT.entry("a/b", "m", "c").startswith(LAYOUT.entries_prefix("a"))
    assert not LAYOUT.entry("a", "b/m", "c").startswith(LAYOUT.entries_prefix("a", "b"))
    assert LAYOUT.entry("a/b", "m", "c").count(b"/") == LAYOUT.entry("a", "m", "c").count(b"/")
    assert not LAYOUT.engine("x/../y").startswith(LAYOUT.leases_prefix())


def test_prefixes_nest_and_lease_keys_sort_by_id() -> None:
    assert LAYOUT.entries_prefix("t").startswith(LAYOUT.entries_prefix())
    assert LAYOUT.engine("e").startswith(LAYOUT.engines_prefix())
    assert LAYOUT.lease(1) < LAYOUT.lease(2) < LAYOUT.lease(0x10)
    assert LAYOUT.leader("lease") == b"/kvbridge/v1/lease/leader"
    assert KeyLayout("/p/").prefix == "/p"
