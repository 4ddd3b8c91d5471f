"""The authorization table over real gRPC: every RPC of every kvbridge proto x every role, and the forged-location
attack (a tenant writing a location that points at another request's blocks).

The RPCs come from the generated file descriptors (every ``kvbridge.*_pb2`` module with a service), not from the
table, so a new RPC without a row fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.duration_pb2 import Duration

import kvbridge
from kvbridge.errors import KvbridgeError, Reason, from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common import authz
from kvbridge_services.common.auth import Role
from tests.fixtures.common import read_message

from .conftest import ACME_KEY, BLOCK, GATEWAY_KEY, MODEL, ROLE_KEYS, SecureStack, call, chain, md


def _kvbridge_methods() -> list[MethodDescriptor]:
    methods = []
    for info in pkgutil.walk_packages(kvbridge.__path__, "kvbridge."):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(info.name)
        for service in module.DESCRIPTOR.services_by_name.values():
            methods.extend(service.methods)
    return methods


METHODS = _kvbridge_methods()


def test_every_rpc_of_every_proto_has_a_row() -> None:
    names = {f"{m.containing_service.full_name}/{m.name}" for m in METHODS}
    assert len({m.containing_service.full_name for m in METHODS}) >= 3  # registry, lease, gateway
    missing = sorted(n for n in names if authz.rule_for(n) is None)
    assert not missing, f"RPCs without a row in kvbridge_services.common.authz TABLE: {missing}"
    stale = sorted(k for k in authz.TABLE if k not in names)
    assert not stale, f"rows naming no RPC: {stale}"


def _target(stack: SecureStack, service: str) -> str:
    return {
        "kvbridge.registry.v1.RegistryService": stack.registry_app.address,
        "kvbridge.lease.v1.LeaseService": stack.lease_app.address,
        "kvbridge.gateway.v1.GatewayService": stack.gateway.grpc_address,
    }[service]


async def _invoke(channel: grpc.aio.Channel, m: MethodDescriptor, key: str) -> grpc.StatusCode:
    """Calls the method with an empty request; the status code (OK when it answered at all)."""
    path = f"/{m.containing_service.full_name}/{m.name}"
    request = message_factory.GetMessageClass(m.input_type)()
    response_cls = message_factory.GetMessageClass(m.output_type)
    kwargs: dict[str, Any] = {
        "request_serializer": type(request).SerializeToString,
        "response_deserializer": response_cls.FromString,
    }
    try:
        if m.client_streaming:
            rpc = channel.stream_stream(path, **kwargs)(iter([request]), metadata=md(key), timeout=5)
            await rpc.read()
            rpc.cancel()
        elif m.server_streaming:
            stream = channel.unary_stream(path, **kwargs)(request, metadata=md(key), timeout=5)
            await stream.read()
            stream.cancel()
        else:
            await channel.unary_unary(path, **kwargs)(request, metadata=md(key), timeout=5)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.PERMISSION_DENIED:
            err = from_rpc_error(exc)
            # Denied by the table (not by a servicer's tenant check): the reason and the method it names.
            assert err.reason == Reason.TENANT_FORBIDDEN.value, err
            assert err.metadata.get("method") == path[1:], err
        return exc.code()
    return grpc.StatusCode.OK


async def test_matrix_every_rpc_times_every_role(secure: SecureStack) -> None:
    channels: dict[str, grpc.aio.Channel] = {}
    seen = 0
    try:
        for m in METHODS:
            service = m.containing_service.full_name
            if service not in channels:
                channels[service] = grpc.aio.insecure_channel(_target(secure, service))
            name = f"{service}/{m.name}"
            rule = authz.rule_for(name)
            assert rule is not None, f"{name} has no row"
            for role in Role:
                code = await _invoke(channels[service], m, ROLE_KEYS[role.value])
                if role in rule.roles:
                    assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), (
                        f"{name} as {role}: {code}, the table allows it"
                    )
                else:
                    assert code is grpc.StatusCode.PERMISSION_DENIED, f"{name} as {role}: {code}, the table denies it"
                seen += 1
    finally:
        for ch in channels.values():
            await ch.close()
    assert seen == len(METHODS) * len(Role)


TOKENS = list(range(300, 300 + 8 * BLOCK))


async def test_forged_location_attack_is_refused_and_the_lookup_is_no_hit(secure: SecureStack) -> None:
    """Acme (a tenant key) tries to point its own conversation at globex's retained blocks."""
    victim = await secure.register("globex", "secret-conv", TOKENS)
    v = victim.entry
    denied: list[str] = []

    async def refused(fn: Any, req: Any) -> None:
        with pytest.raises(KvbridgeError) as info:
            await call(fn, req, ACME_KEY)
        assert info.value.code is grpc.StatusCode.PERMISSION_DENIED, info.value
        assert info.value.reason == Reason.TENANT_FORBIDDEN.value
        denied.append(info.value.metadata["method"])

    engine = types_pb2.Engine(
        engine_id="evil",
        role=types_pb2.ENGINE_ROLE_DECODE,
        model=MODEL,
        http_url="http://127.0.0.1:1",
        kv_host="127.0.0.1",
        kv_port=1,
        block_size=BLOCK,
    )
    await refused(secure.registry.RegisterEngine, registry_pb2.RegisterEngineRequest(engine=engine))
    await refused(
        secure.lease.GrantLease,
        lease_pb2.GrantLeaseRequest(
            kind=lease_pb2.LEASE_KIND_ENTRY,
            engine_id="d0",
            model=MODEL,
            conversation_key="mine",
            ttl=Duration(seconds=60),
        ),
    )
    await refused(
        secure.lease.GrantLease,
        lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_NODE, engine_id="evil", ttl=Duration(seconds=60)),
    )
    forged = registry_pb2.Entry(
        key=registry_pb2.EntryKey(model=MODEL, conversation_key="mine"),
        engine_id=v.engine_id,
        engine_request_id=v.engine_request_id,
        block_ids=v.block_ids,
        block_size=BLOCK,
        token_count=len(TOKENS),
        block_hashes=chain(TOKENS, "acme"),
        lease_id=v.lease_id,
        epoch=1,
    )
    await refused(secure.registry.RegisterEntry, registry_pb2.RegisterEntryRequest(request_id="forge-1", entry=forged))
    assert denied == [
        "kvbridge.registry.v1.RegistryService/RegisterEngine",
        "kvbridge.lease.v1.LeaseService/GrantLease",
        "kvbridge.lease.v1.LeaseService/GrantLease",
        "kvbridge.registry.v1.RegistryService/RegisterEntry",
    ]
    look = await call(
        secure.registry.LookupEntry,
        registry_pb2.LookupEntryRequest(
            model=MODEL, conversation_key="mine", block_hashes=chain(TOKENS, "acme"), block_size=BLOCK
        ),
        ACME_KEY,
    )
    assert look.verdict == registry_pb2.LOOKUP_VERDICT_NOT_FOUND and not look.HasField("location")
    content = await call(
        secure.registry.LookupEntry,
        registry_pb2.LookupEntryRequest(model=MODEL, block_hashes=chain(TOKENS, "acme"), block_size=BLOCK),
        ACME_KEY,
    )
    assert content.verdict == registry_pb2.LOOKUP_VERDICT_NOT_FOUND


async def test_tenant_lookups_are_redacted(secure: SecureStack) -> None:
    await secure.register("acme", "c-red", TOKENS)
    req = registry_pb2.LookupEntryRequest(
        tenant="acme", model=MODEL, conversation_key="c-red", block_hashes=chain(TOKENS, "acme"), block_size=BLOCK
    )
    full = await call(secure.registry.LookupEntry, req, GATEWAY_KEY)
    assert full.verdict == registry_pb2.LOOKUP_VERDICT_HIT
    assert full.location.block_ids and full.location.engine.kv_port and full.location.engine_request_id
    req.tenant = ""
    mine = await call(secure.registry.LookupEntry, req, ACME_KEY)
    assert mine.verdict == registry_pb2.LOOKUP_VERDICT_HIT and mine.verified_tokens == full.verified_tokens
    loc = mine.location
    assert not loc.block_ids and not loc.engine_request_id
    assert loc.engine == types_pb2.Engine(engine_id="d0", role=full.location.engine.role, model=MODEL)
    assert loc.lease_id == full.location.lease_id and loc.conversation_key == "c-red"


async def test_a_tenant_learns_nothing_of_another_tenants_lease(secure: SecureStack) -> None:
    """Lease ids are predictable: globex's live and ended lease ids look the same to acme as a never-granted one."""
    live = await secure.entry_lease("globex", "g-live")
    ended = await secure.entry_lease("globex", "g-ended")
    await call(
        secure.lease.RevokeLease,
        lease_pb2.RevokeLeaseRequest(lease_id=ended, reason=types_pb2.REVOKE_REASON_CLIENT_CLOSED),
        ROLE_KEYS["operator"],
    )
    never = ended + 1000
    call_ = secure.lease.KeepAlive(
        iter([lease_pb2.KeepAliveRequest(lease_ids=[live, ended, never])]), metadata=md(ACME_KEY), timeout=5
    )
    resp = await read_message(call_, lease_pb2.KeepAliveResponse)
    call_.cancel()
    views = [(s.alive, s.reason, s.error, s.HasField("deadline")) for s in resp.statuses]
    assert views == [(False, types_pb2.REVOKE_REASON_UNSPECIFIED, types_pb2.ERROR_REASON_LEASE_NOT_FOUND, False)] * 3
    # The owner's side still renews, and an engine still learns the end reason.
    call_ = secure.lease.KeepAlive(
        iter([lease_pb2.KeepAliveRequest(lease_ids=[live, ended])]), metadata=md(ROLE_KEYS["engine"]), timeout=5
    )
    resp = await read_message(call_, lease_pb2.KeepAliveResponse)
    call_.cancel()
    assert [s.alive for s in resp.statuses] == [True, False]
    assert resp.statuses[1].reason == types_pb2.REVOKE_REASON_CLIENT_CLOSED
