"""Authentication on every service: no key / wrong key => UNAUTHENTICATED (gRPC) or 401 (HTTP); mutual TLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvbridge.errors import KvbridgeError, Reason
from kvbridge.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.sdk import ClientOptions, RegistryClient, open_channel
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings

from .conftest import ACME_KEY, SERVICE_KEY, SecureStack, call, md, write_keys
from .pki import make_pki

BAD_KEYS = [None, "wrong-key", ""]


def _unauthenticated(err: KvbridgeError) -> None:
    assert err.code is grpc.StatusCode.UNAUTHENTICATED, err
    assert err.reason == Reason.UNAUTHENTICATED.value


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_registry_rpcs_refuse_unauthenticated(secure: SecureStack, key: str | None) -> None:
    r = secure.registry
    calls = [
        (r.RegisterEngine, registry_pb2.RegisterEngineRequest()),
        (r.DeregisterEngine, registry_pb2.DeregisterEngineRequest(engine_id="d0")),
        (r.GetEngine, registry_pb2.GetEngineRequest(engine_id="d0")),
        (r.ListEngines, registry_pb2.ListEnginesRequest()),
        (r.RegisterEntry, registry_pb2.RegisterEntryRequest()),
        (r.LookupEntry, registry_pb2.LookupEntryRequest(tenant="acme", model="m", conversation_key="c")),
        (r.GetEntry, registry_pb2.GetEntryRequest()),
        (r.ListEntries, registry_pb2.ListEntriesRequest(tenant="acme")),
        (r.DeleteEntry, registry_pb2.DeleteEntryRequest()),
    ]
    for fn, req in calls:
        with pytest.raises(KvbridgeError) as info:
            await call(fn, req, key)
        _unauthenticated(info.value)
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        async for _ in r.WatchEntries(registry_pb2.WatchEntriesRequest(tenant="acme"), metadata=md(key)):
            pass
    assert raw.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_lease_rpcs_refuse_unauthenticated(secure: SecureStack, key: str | None) -> None:
    s = secure.lease
    calls = [
        (s.GrantLease, lease_pb2.GrantLeaseRequest(kind=lease_pb2.LEASE_KIND_ENTRY, engine_id="d0", model="m")),
        (s.RevokeLease, lease_pb2.RevokeLeaseRequest(lease_id=1)),
        (s.GetLease, lease_pb2.GetLeaseRequest(lease_id=1)),
        (s.ListLeases, lease_pb2.ListLeasesRequest()),
    ]
    for fn, req in calls:
        with pytest.raises(KvbridgeError) as info:
            await call(fn, req, key)
        _unauthenticated(info.value)
    for stream in (
        s.KeepAlive(iter([lease_pb2.KeepAliveRequest(lease_ids=[1])]), metadata=md(key)),
        s.WatchLeases(lease_pb2.WatchLeasesRequest(), metadata=md(key)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in stream:
                pass
        assert raw.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_gateway_grpc_refuses_unauthenticated(secure: SecureStack, key: str | None) -> None:
    async with grpc.aio.insecure_channel(secure.gateway.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        with pytest.raises(KvbridgeError) as info:
            await call(stub.ListModels, gateway_pb2.ListModelsRequest(), key)
        _unauthenticated(info.value)
        with pytest.raises(KvbridgeError) as info:
            await call(
                stub.CloseConversation, gateway_pb2.CloseConversationRequest(model="m", conversation_id="c"), key
            )
        _unauthenticated(info.value)
        req = gateway_pb2.CreateChatCompletionRequest(
            model="sim-model", messages=[gateway_pb2.ChatMessage(role="user", content="hi")]
        )
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in stub.CreateChatCompletion(req, metadata=md(key)):
                pass
        assert raw.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic a2V5LWFjbWU=", "Bearer"])
async def test_gateway_http_refuses_unauthenticated(secure: SecureStack, header: str | None) -> None:
    async with secure.http(key=None) as client:
        headers = {"authorization": header} if header is not None else {}
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for method, path, payload in (
            ("POST", "/v1/chat/completions", body),
            ("POST", "/v1/completions", {"model": "sim-model", "prompt": "hi"}),
            ("GET", "/v1/models", None),
        ):
            resp = await client.request(method, path, json=payload, headers=headers)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.json()["error"]["code"] == Reason.UNAUTHENTICATED.value.lower()
    stats = await _requests_seen(secure)
    assert stats == 0, "an unauthenticated request reached an engine"


async def _requests_seen(secure: SecureStack) -> int:
    return secure.prefill.engine.stats.requests + secure.decode.engine.stats.requests


async def test_gateway_http_accepts_valid_key(secure: SecureStack) -> None:
    async with secure.http(ACME_KEY) as client:
        resp = await client.get("/v1/models")
        assert resp.status_code == 200


# ---- mutual TLS -------------------------------------------------------------------------------


async def test_registry_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki()
    files = {}
    for name in ("ca_pem", "server_cert", "server_key"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(getattr(pki, name))
    server = ServerSettings(
        shutdown_grace_s=0,
        tls_cert_file=files["server_cert"],
        tls_key_file=files["server_key"],
        tls_client_ca_file=files["ca_pem"],
    )
    store = MemoryStore()
    app = RegistryApp(
        store,
        settings=RegistrySettings(port=0),
        server_settings=server,
        auth=Authenticator.from_file(write_keys(tmp_path / "keys.json")),
    )
    await app.start()
    try:
        good = ClientOptions(
            api_key=SERVICE_KEY,
            root_certificates=pki.ca_pem,
            client_certificate_chain=pki.client_cert,
            client_private_key=pki.client_key,
            tls_server_name="localhost",
            max_attempts=1,
            timeout_s=3,
        )
        client = RegistryClient(app.address, good)
        try:
            assert list((await client.list_engines()).engines) == []
        finally:
            await client.close()
        ch = open_channel(app.address, good)
        try:
            resp = await registry_pb2_grpc.RegistryServiceStub(ch).ListEngines(
                registry_pb2.ListEnginesRequest(), metadata=md(SERVICE_KEY), timeout=3
            )
            assert list(resp.engines) == []
        finally:
            await ch.close()
        # The right key is not enough without a certificate from the right CA.
        for opts in (
            ClientOptions(api_key=SERVICE_KEY, root_certificates=pki.ca_pem, tls_server_name="localhost"),
            ClientOptions(
                api_key=SERVICE_KEY,
                root_certificates=pki.ca_pem,
                tls_server_name="localhost",
                client_certificate_chain=pki.rogue_cert,
                client_private_key=pki.rogue_key,
            ),
            ClientOptions(api_key=SERVICE_KEY),
        ):
            ch = open_channel(app.address, opts)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await registry_pb2_grpc.RegistryServiceStub(ch).ListEngines(
                        registry_pb2.ListEnginesRequest(), metadata=md(SERVICE_KEY), timeout=3
                    )
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            finally:
                await ch.close()
        # TLS and API keys are independent layers: a certified client still needs a valid key.
        ch = open_channel(
            app.address,
            ClientOptions(
                root_certificates=pki.ca_pem,
                tls_server_name="localhost",
                client_certificate_chain=pki.client_cert,
                client_private_key=pki.client_key,
            ),
        )
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await registry_pb2_grpc.RegistryServiceStub(ch).ListEngines(
                    registry_pb2.ListEnginesRequest(), timeout=3
                )
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        finally:
            await ch.close()
    finally:
        await app.stop(0)
        await store.close()


def test_tls_settings_must_come_in_pairs(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ServerSettings(tls_cert_file=tmp_path / "c.pem")
    with pytest.raises(ValueError):
        ServerSettings(tls_client_ca_file=tmp_path / "ca.pem")
    with pytest.raises(ValueError):
        open_channel("127.0.0.1:1", ClientOptions(client_certificate_chain=b"x", client_private_key=b"y"))
