"""Registry fixtures: a RegistryApp on a real gRPC loopback port, over MemoryStore or real etcd.

The lease manager is not part of these tests: lease records are written into
the store the way it writes them (``KeyLayout.lease(id)`` -> lease.v1.Lease,
attached to a store lease of the same id).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Store
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings

SECRET = b"registry-test-secret-0123456789"
MODEL = "Qwen/Qwen3-0.6B"
BLOCK = 4


def etcd_store(endpoints: Sequence[str]) -> Store:
    from kvbridge_services.common.store.etcd import EtcdStore

    store: Store = EtcdStore(list(endpoints))
    return store


def chain(tokens: Sequence[int], tenant: str = "acme", model: str = MODEL, salt: str = "") -> list[bytes]:
    return hashchain.chain(SECRET, tenant, model, salt, BLOCK, tokens)


class RecordingReleaser:
    def __init__(self) -> None:
        self.revoked: list[tuple[int, int]] = []

    async def revoke(self, lease_id: int, reason: Any) -> None:
        self.revoked.append((lease_id, int(reason)))


@dataclass
class Env:
    store: Store
    keys: KeyLayout
    app: RegistryApp
    channel: grpc.aio.Channel
    stub: registry_pb2_grpc.RegistryServiceAsyncStub
    releaser: RecordingReleaser
    _req: int = field(default=0)

    async def lease(
        self,
        *,
        tenant: str = "acme",
        engine_id: str = "d0",
        conv: str = "",
        model: str = MODEL,
        kind: lease_pb2.LeaseKind.ValueType = lease_pb2.LEASE_KIND_ENTRY,
        ttl_s: int = 60,
    ) -> int:
        lease_id = await self.store.grant_lease(ttl_s)
        record = lease_pb2.Lease(
            lease_id=lease_id,
            kind=kind,
            tenant=tenant,
            engine_id=engine_id,
            model=model if kind == lease_pb2.LEASE_KIND_ENTRY else "",
            conversation_key=conv,
        )
        await self.store.put(self.keys.lease(lease_id), record.SerializeToString(), lease=lease_id)
        return lease_id

    async def engine(self, engine_id: str = "d0", *, model: str = MODEL, groups: int = 1) -> types_pb2.Engine:
        node = await self.lease(tenant="", engine_id=engine_id, kind=lease_pb2.LEASE_KIND_NODE)
        engine = types_pb2.Engine(
            engine_id=engine_id,
            role=types_pb2.ENGINE_ROLE_DECODE,
            model=model,
            http_url="http://10.0.0.5:8000",
            kv_host="10.0.0.5",
            kv_port=5600,
            dp_size=1,
            tp_size=1,
            block_size=BLOCK,
            kv_group_count=groups,
            node_lease_id=node,
        )
        resp = await self.stub.RegisterEngine(registry_pb2.RegisterEngineRequest(engine=engine))
        return resp.engine

    def entry_request(
        self,
        tokens: Sequence[int],
        *,
        conv: str = "c1",
        tenant: str = "acme",
        epoch: int = 1,
        lease_id: int,
        engine_id: str = "d0",
        request_id: str | None = None,
        groups: int = 1,
    ) -> registry_pb2.RegisterEntryRequest:
        self._req += 1
        n_blocks = -(-len(tokens) // BLOCK)
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant=tenant, model=MODEL, conversation_key=conv),
            engine_id=engine_id,
            engine_request_id=f"req-{self._req}",
            block_ids=[types_pb2.BlockIds(ids=list(range(100 * g, 100 * g + n_blocks))) for g in range(groups)],
            block_size=BLOCK,
            token_count=len(tokens),
            block_hashes=chain(tokens, tenant),
            lease_id=lease_id,
            epoch=epoch,
        )
        return registry_pb2.RegisterEntryRequest(request_id=request_id or f"rq-{uuid.uuid4().hex}", entry=entry)

    async def register(self, tokens: Sequence[int], **kw: Any) -> registry_pb2.RegisterEntryResponse:
        tenant = kw.get("tenant", "acme")
        conv = kw.get("conv", "c1")
        if "lease_id" not in kw:
            kw["lease_id"] = await self.lease(tenant=tenant, engine_id=kw.get("engine_id", "d0"), conv=conv)
        return await self.stub.RegisterEntry(self.entry_request(tokens, **kw))

    async def lookup(
        self,
        tokens: Sequence[int],
        *,
        conv: str = "c1",
        tenant: str = "acme",
        min_tokens: int = 0,
        chain_tenant: str | None = None,
    ) -> registry_pb2.LookupEntryResponse:
        return await self.stub.LookupEntry(
            registry_pb2.LookupEntryRequest(
                tenant=tenant,
                model=MODEL,
                conversation_key=conv,
                block_hashes=chain(tokens, chain_tenant or tenant),
                block_size=BLOCK,
                min_tokens=min_tokens,
            )
        )


async def start_env(store: Store, **settings: Any) -> Env:
    keys = KeyLayout()
    releaser = RecordingReleaser()
    app = RegistryApp(
        store,
        settings=RegistrySettings(port=0, **settings),
        server_settings=ServerSettings(shutdown_grace_s=0),
        keys=keys,
        releaser=releaser,
    )
    await app.start()
    channel = grpc.aio.insecure_channel(app.address)
    return Env(store, keys, app, channel, registry_pb2_grpc.RegistryServiceStub(channel), releaser)


async def stop_env(env: Env) -> None:
    await env.channel.close()
    await env.app.stop(0)


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        s: Store = MemoryStore()
    else:
        server = request.getfixturevalue("etcd_server")
        s = etcd_store([server.endpoint])
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def env(store: Store) -> AsyncIterator[Env]:
    e = await start_env(store)
    try:
        yield e
    finally:
        await stop_env(e)
