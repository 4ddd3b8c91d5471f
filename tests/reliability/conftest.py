"""A secured control plane for reliability tests: API keys on every service, one MemoryStore, real gRPC.

Principals (keys file written by the fixture): tenants ``acme`` and ``globex``; the key the gateway uses towards
registry and lease manager (``key-service``: roles gateway and engine, as in compatibility mode, since it also
registers the static engines and their entries); one key per single role for the authorization matrix.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge import hashchain
from kvbridge.errors import KvbridgeError, from_rpc_error
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack
from tests.tools.engine_sim import SimConfig, SimServer

MODEL = "sim-model"
BLOCK = 16
SECRET_HEX = "00112233445566778899aabbccddeeff"
SECRET = bytes.fromhex(SECRET_HEX)
ACME_KEY, GLOBEX_KEY, SERVICE_KEY = "key-acme", "key-globex", "key-service"
GATEWAY_KEY, ENGINE_KEY, OPERATOR_KEY = "key-gateway-only", "key-engine", "key-operator"
KEYS_FILE = {
    ACME_KEY: {"name": "acme-app", "role": "tenant", "tenant": "acme"},
    GLOBEX_KEY: {"name": "globex-app", "role": "tenant", "tenant": "globex"},
    SERVICE_KEY: {"name": "gateway", "roles": ["gateway", "engine"]},
    GATEWAY_KEY: {"name": "gateway-only", "role": "gateway"},
    ENGINE_KEY: {"name": "connector", "role": "engine"},
    OPERATOR_KEY: {"name": "operator", "role": "operator"},
}
# The key of each single role, for tests that call as exactly one role.
ROLE_KEYS = {"tenant": ACME_KEY, "gateway": GATEWAY_KEY, "engine": ENGINE_KEY, "operator": OPERATOR_KEY}
# gRPC codes a rejected request may get; INTERNAL / UNKNOWN never.
CLEAN_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
}


def md(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def chain(tokens: Sequence[int], tenant: str, salt: str = "") -> list[bytes]:
    return hashchain.chain(SECRET, tenant, MODEL, salt, BLOCK, tokens)


async def call(fn: Any, request: Any, key: str | None = SERVICE_KEY, timeout: float = 10.0) -> Any:
    """A unary call; raises the typed KvbridgeError (with its ErrorInfo reason) on failure."""
    try:
        return await fn(request, metadata=md(key), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None


def assert_clean(err: KvbridgeError) -> None:
    assert err.code in CLEAN_CODES, f"unclean status {err.code}: {err}"
    assert err.reason, f"no ErrorInfo reason on {err.code}: {err}"


@dataclass
class SecureStack:
    store: MemoryStore
    lease_app: LeaseApp
    registry_app: RegistryApp
    gateway: GatewayApp
    prefill: SimServer
    decode: SimServer
    channels: list[grpc.aio.Channel]
    registry: registry_pb2_grpc.RegistryServiceAsyncStub
    lease: lease_pb2_grpc.LeaseServiceAsyncStub

    def http(self, key: str | None = ACME_KEY) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.gateway.http_url, headers=headers, timeout=30)

    async def settle(self) -> None:
        await self.gateway.core.router.drain()

    async def entry_lease(self, tenant: str, conv: str, key: str = SERVICE_KEY) -> int:
        resp = await call(
            self.lease.GrantLease,
            lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant=tenant,
                engine_id="d0",
                model=MODEL,
                conversation_key=conv,
                ttl=Duration(seconds=60),
            ),
            key,
        )
        return int(resp.lease.lease_id)

    async def register(
        self,
        tenant: str,
        conv: str,
        tokens: Sequence[int],
        *,
        key: str = SERVICE_KEY,
        epoch: int = 1,
        request_id: str = "",
    ) -> registry_pb2.RegisterEntryResponse:
        lease_id = await self.entry_lease(tenant, conv)
        n_blocks = len(tokens) // BLOCK
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant=tenant, model=MODEL, conversation_key=conv),
            engine_id="d0",
            engine_request_id=f"req-{conv}-{epoch}",
            block_ids=[types_pb2.BlockIds(ids=list(range(1, n_blocks + 1)))],
            block_size=BLOCK,
            token_count=n_blocks * BLOCK,
            block_hashes=chain(tokens[: n_blocks * BLOCK], tenant),
            lease_id=lease_id,
            epoch=epoch,
        )
        req = registry_pb2.RegisterEntryRequest(request_id=request_id or f"rq-{tenant}-{conv}-{epoch}", entry=entry)
        result: registry_pb2.RegisterEntryResponse = await call(self.registry.RegisterEntry, req, key)
        return result

    async def entry_count(self) -> int:
        resp = await call(
            self.registry.ListEntries, registry_pb2.ListEntriesRequest(tenant="acme", page_size=1000), OPERATOR_KEY
        )
        other = await call(
            self.registry.ListEntries, registry_pb2.ListEntriesRequest(tenant="globex", page_size=1000), OPERATOR_KEY
        )
        return len(resp.entries) + len(other.entries)


def write_keys(path: Path) -> Path:
    path.write_text(json.dumps(KEYS_FILE))
    return path


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[SecureStack]:
    auth = Authenticator.from_file(write_keys(tmp_path / "keys.json"))
    store = MemoryStore()
    p = SimServer(SimConfig(role="prefill", engine_id="p0", model=MODEL, block_size=BLOCK))
    d = SimServer(SimConfig(role="decode", engine_id="d0", model=MODEL, block_size=BLOCK))
    async with contextlib.AsyncExitStack() as held:
        held.push_async_callback(store.close)
        for sim in (p, d):
            await held.enter_async_context(sim)
        settings = GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            control_api_key=SERVICE_KEY,
            hash_secret_hex=SECRET_HEX,
            default_block_size=BLOCK,
            reuse_threshold_tokens=BLOCK,
            prefill_engines=[
                StaticEngine(
                    url=p.url,
                    model=MODEL,
                    engine_id="p0",
                    kv_host="127.0.0.1",
                    kv_port=p.cfg.port,
                    block_size=BLOCK,
                    register_in_registry=True,
                )
            ],
            decode_engines=[
                StaticEngine(
                    url=d.url,
                    model=MODEL,
                    engine_id="d0",
                    kv_host="127.0.0.1",
                    kv_port=d.cfg.port,
                    block_size=BLOCK,
                    register_in_registry=True,
                )
            ],
            engines_from_registry=False,
            health_interval_s=0.5,
        )
        services = await held.enter_async_context(
            ServiceStack(
                store,
                lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
                registry=RegistrySettings(port=0, lease_service_api_key=SERVICE_KEY),
                gateway=settings,
                server=ServerSettings(shutdown_grace_s=0.2),
                auth=auth,
                gateway_auth=auth,
                stop_grace_s=0.1,
            )
        )
        assert services.lease is not None and services.registry is not None and services.gateway is not None
        reg_ch = grpc.aio.insecure_channel(services.registry.address)
        lease_ch = grpc.aio.insecure_channel(services.lease.address)
        for ch in (reg_ch, lease_ch):
            held.push_async_callback(ch.close)
        yield SecureStack(
            store,
            services.lease,
            services.registry,
            services.gateway,
            p,
            d,
            [reg_ch, lease_ch],
            registry_pb2_grpc.RegistryServiceStub(reg_ch),
            lease_pb2_grpc.LeaseServiceStub(lease_ch),
        )
