"""Roles from the keys file, the authorization table's rules, and docs/security.md showing exactly that table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.errors import PermissionDenied, Reason
from kvbridge_services.common import authz
from kvbridge_services.common.auth import DEV_PRINCIPAL, SERVICE_ROLES, Authenticator, Principal, Role

DOCS = Path(__file__).resolve().parents[3] / "docs" / "security.md"


def _load(tmp_path: Path, spec: dict[str, object]) -> Authenticator:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k": spec}))
    return Authenticator.from_file(path)


def test_keys_file_roles(tmp_path: Path) -> None:
    assert _load(tmp_path, {"name": "a", "role": "tenant", "tenant": "acme"}).authenticate_key("k") == Principal(
        "a", "acme", frozenset({Role.TENANT})
    )
    both = _load(tmp_path, {"name": "gw", "roles": ["gateway", "engine"]}).authenticate_key("k")
    assert both.roles == {Role.GATEWAY, Role.ENGINE} and both.tenant is None
    # A pre-roles tenant entry is still a tenant key.
    assert _load(tmp_path, {"name": "a", "tenant": "acme"}).authenticate_key("k").roles == {Role.TENANT}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"name": "svc", "tenant": None}, "'role'"),  # the retired service principal: migrate, do not guess
        ({"name": "x", "role": "admin"}, "unknown role 'admin'"),
        ({"name": "x", "role": "tenant"}, "needs a tenant"),
        ({"name": "x", "role": "operator", "tenant": "acme"}, "only the tenant role has a tenant"),
        ({"name": "x", "roles": ["tenant", "gateway"], "tenant": "acme"}, "excludes other roles"),
        ({"name": "x", "roles": []}, "non-empty list"),
        ({"name": "x", "role": "engine", "roles": ["engine"]}, "not both"),
    ],
)
def test_keys_file_mistakes_are_named(tmp_path: Path, spec: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _load(tmp_path, spec)


def test_unknown_methods_are_denied_even_to_every_role() -> None:
    assert DEV_PRINCIPAL.roles == SERVICE_ROLES
    assert not authz.allowed(DEV_PRINCIPAL, "/kvbridge.registry.v1.RegistryService/NoSuchRpc")
    with pytest.raises(PermissionDenied) as info:
        authz.require(DEV_PRINCIPAL, "/kvbridge.registry.v1.RegistryService/NoSuchRpc")
    assert info.value.reason == Reason.TENANT_FORBIDDEN.value
    assert info.value.metadata["method"] == "kvbridge.registry.v1.RegistryService/NoSuchRpc"


def test_only_engines_write_locations() -> None:
    reg = "kvbridge.registry.v1.RegistryService/"
    writers = {reg + "RegisterEngine", reg + "RegisterEntry", "kvbridge.lease.v1.LeaseService/GrantLease"}
    for method in writers:
        assert authz.TABLE[method].roles == {Role.ENGINE}, method
    tenant_rpcs = {m for m, rule in authz.TABLE.items() if Role.TENANT in rule.roles}
    gw = "kvbridge.gateway.v1.GatewayService/"
    assert tenant_rpcs == {
        reg + "LookupEntry",
        "kvbridge.lease.v1.LeaseService/KeepAlive",
        gw + "CreateChatCompletion",
        gw + "CreateCompletion",
        gw + "ListModels",
        gw + "CloseConversation",
    }


def test_docs_show_the_table_of_the_code() -> None:
    text = DOCS.read_text()
    begin, end = "<!-- authz-table:begin -->\n", "\n<!-- authz-table:end -->"
    assert begin in text and end in text, "docs/security.md lost its table markers"
    shown = text[text.index(begin) + len(begin) : text.index(end)]
    assert shown == authz.markdown_table(), (
        "docs/security.md's table differs from kvbridge_services.common.authz: paste authz.markdown_table()"
    )
