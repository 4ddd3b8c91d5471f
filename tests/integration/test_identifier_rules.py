"""Identifier fuzz: the registry, the lease manager and the gateway's HTTP front door accept and refuse the
same tenants, models and conversation keys, the ones kvbridge.ids accepts; a refusal is INVALID_ARGUMENT /
INVALID_FIELD naming the field. Real servers over loopback (gRPC and HTTP), one embedded store.

Before kvbridge.ids, a tenant ``acme corp`` passed the gateway and the lease manager and the registry refused
it, which the turn reported as ``declined:registry_unavailable``.
"""

from __future__ import annotations

import random
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge import ids
from kvbridge.errors import KvbridgeError, from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.fixtures.common import wait_leader

TENANT_HEADER = "x-kvbridge-tenant"

# Edge cases every kind is tried with, then seeded random strings (_generated: the same list every run).
EDGES = [
    "acme",
    "acme corp",
    " acme",
    "acme ",
    "",
    "a",
    "a" * 128,
    "a" * 129,
    "a" * 256,
    "a" * 257,
    "Qwen/Qwen3-0.6B",
    "org/model@rev",
    "chat 42",
    "team-7.eu",
    "10.0.0.5:8100",
    "tab\there",
    "nl\nhere",
    "nul\0",
    "ünïcode",
    "a/b",
    "a,b",
    "a;b",
    "x" * 64 + " " + "y" * 64,
    "~!@#$%^&*()",
    "\x7f",
    "emoji😀",
]


def _generated(n: int, seed: int) -> list[str]:
    """Seeded random strings: each from one of several alphabets (the name alphabet, printable ASCII, all of
    ASCII with controls, a little non-ASCII), with lengths clustered at the rules' bounds."""
    rnd = random.Random(seed)
    alphabets = [
        string.ascii_letters + string.digits + "._:-",
        string.printable[:95],
        "".join(map(chr, range(128))),
        string.ascii_letters + " /@ü€😀",
    ]
    lengths = [1, 2, 5, 20, 127, 128, 129, 255, 256, 257]
    return ["".join(rnd.choice(rnd.choice(alphabets)) for _ in range(rnd.choice(lengths))) for _ in range(n)]


CANDIDATES = EDGES + _generated(150, seed=15)


@dataclass
class Stack:
    registry: registry_pb2_grpc.RegistryServiceAsyncStub
    lease: lease_pb2_grpc.LeaseServiceAsyncStub
    http: httpx.AsyncClient


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    auth = Authenticator({})  # development mode on loopback: every caller may name any tenant
    store = MemoryStore()
    server = ServerSettings(shutdown_grace_s=0.1)
    lease = LeaseApp(store, LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5), server, auth=auth)
    await lease.start()
    await wait_leader(lease)
    registry = RegistryApp(
        store, settings=RegistrySettings(port=0, lease_service_target=lease.address), server_settings=server, auth=auth
    )
    await registry.start()
    gw = GatewayApp(
        GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            registry_address="",
            lease_address="",
            engines_from_registry=False,
        ),
        auth=auth,
    )
    await gw.start()
    reg_ch = grpc.aio.insecure_channel(registry.address)
    lease_ch = grpc.aio.insecure_channel(lease.address)
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        try:
            yield Stack(registry_pb2_grpc.RegistryServiceStub(reg_ch), lease_pb2_grpc.LeaseServiceStub(lease_ch), http)
        finally:
            await reg_ch.close()
            await lease_ch.close()
            await gw.stop()
            await registry.stop(0.1)
            await lease.stop(0.1)
            await store.close()


async def _grpc_verdict(fn: object, request: object, field: str) -> bool:
    """True: accepted; False: refused with INVALID_ARGUMENT / INVALID_FIELD naming ``field``; else the test fails."""
    try:
        await fn(request, timeout=10)  # type: ignore[operator]
    except grpc.aio.AioRpcError as exc:
        err: KvbridgeError = from_rpc_error(exc)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (field, request, err)
        assert (err.reason, err.metadata.get("field")) == ("INVALID_FIELD", field), (field, request, err)
        return False
    return True


def _http_verdict(resp: httpx.Response, field: str) -> bool:
    """True: the identifier passed (the turn then fails for want of an engine: 404/503); False: refused (400)."""
    if resp.status_code == 400:
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_field", field), resp.text
        return False
    assert resp.status_code in (404, 503), resp.text
    return True


def _header_safe(value: str) -> bool:
    """Sendable as an HTTP header value unchanged (no control characters, no edge whitespace, Latin-1)."""
    return bool(value) and value == value.strip() and all(" " <= c <= "~" for c in value)


def _lookup(tenant: str = "t", model: str = "m", conversation_key: str = "") -> registry_pb2.LookupEntryRequest:
    return registry_pb2.LookupEntryRequest(tenant=tenant, model=model, conversation_key=conversation_key, block_size=16)


def _grant(tenant: str = "t", model: str = "m", conversation_key: str = "c") -> lease_pb2.GrantLeaseRequest:
    return lease_pb2.GrantLeaseRequest(
        kind=lease_pb2.LEASE_KIND_ENTRY,
        tenant=tenant,
        engine_id="d0",
        model=model,
        conversation_key=conversation_key,
        ttl=Duration(seconds=30),
    )


def _chat(model: str = "m", conversation_id: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


def test_the_candidates_cover_both_answers() -> None:
    for rule in (ids.TENANT, ids.MODEL, ids.CONVERSATION_KEY):
        verdicts = {rule.valid(s) for s in CANDIDATES if s}
        assert verdicts == {True, False}, rule.kind
    assert not ids.TENANT.valid("acme corp") and ids.CONVERSATION_KEY.valid("acme corp")


async def test_tenant_is_accepted_and_refused_alike_everywhere(stack: Stack) -> None:
    for s in CANDIDATES:
        if not s:
            continue  # empty: "the caller's tenant" on the gRPC services, "default" at the gateway
        expected = ids.TENANT.valid(s)
        assert await _grpc_verdict(stack.registry.LookupEntry, _lookup(tenant=s), "tenant") is expected, s
        listing = lease_pb2.ListLeasesRequest(tenant=s)
        assert await _grpc_verdict(stack.lease.ListLeases, listing, "tenant") is expected, s
        assert await _grpc_verdict(stack.lease.GrantLease, _grant(tenant=s), "tenant") is expected, s
        if _header_safe(s):
            resp = await stack.http.post("/v1/chat/completions", json=_chat(), headers={TENANT_HEADER: s})
            assert _http_verdict(resp, TENANT_HEADER) is expected, s


async def test_model_is_accepted_and_refused_alike_everywhere(stack: Stack) -> None:
    for s in CANDIDATES:
        expected = ids.MODEL.valid(s)
        assert await _grpc_verdict(stack.registry.LookupEntry, _lookup(model=s), "model") is expected, s
        assert await _grpc_verdict(stack.lease.GrantLease, _grant(model=s), "model") is expected, s
        resp = await stack.http.post("/v1/chat/completions", json=_chat(model=s))
        assert _http_verdict(resp, "model") is expected, s


async def test_conversation_key_is_accepted_and_refused_alike_everywhere(stack: Stack) -> None:
    for s in CANDIDATES:
        if not s:
            continue  # empty: no conversation (a content lookup) on the registry; refused by the lease manager
        expected = ids.CONVERSATION_KEY.valid(s)
        assert (
            await _grpc_verdict(stack.registry.LookupEntry, _lookup(conversation_key=s), "conversation_key") is expected
        ), s
        assert (
            await _grpc_verdict(stack.lease.GrantLease, _grant(conversation_key=s), "conversation_key") is expected
        ), s
        resp = await stack.http.post("/v1/chat/completions", json=_chat(conversation_id=s))
        assert _http_verdict(resp, "conversation_id") is expected, s
