"""Async client of kvbridge.registry.v1.RegistryService."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc
from kvbridge.types.v1 import types_pb2

from .channel import BaseClient


def lookup_request(
    tenant: str, model: str, conversation_key: str, block_hashes: Sequence[bytes], block_size: int, min_tokens: int
) -> pb.LookupEntryRequest:
    """A keyed lookup of the chain ``block_hashes``, packed: one bytes field instead of one per block, far cheaper
    for the registry to parse."""
    return pb.LookupEntryRequest(
        tenant=tenant,
        model=model,
        conversation_key=conversation_key,
        block_hashes_packed=b"".join(block_hashes),
        block_size=block_size,
        min_tokens=min_tokens,
    )


class RegistryClient(BaseClient):
    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._registry = pb_grpc.RegistryServiceStub(channel)

    def _stub(self) -> Any:
        return self._registry

    async def register_engine(self, engine: types_pb2.Engine) -> types_pb2.Engine:
        resp: pb.RegisterEngineResponse = await self._unary("RegisterEngine", pb.RegisterEngineRequest(engine=engine))
        return resp.engine

    async def deregister_engine(self, engine_id: str) -> None:
        await self._unary("DeregisterEngine", pb.DeregisterEngineRequest(engine_id=engine_id))

    async def list_engines(self, model: str = "", page_size: int = 0, page_token: str = "") -> pb.ListEnginesResponse:
        req = pb.ListEnginesRequest(model=model, page_size=page_size, page_token=page_token)
        resp: pb.ListEnginesResponse = await self._unary("ListEngines", req)
        return resp

    async def register_entry(self, request_id: str, entry: pb.Entry) -> pb.RegisterEntryResponse:
        resp: pb.RegisterEntryResponse = await self._unary(
            "RegisterEntry", pb.RegisterEntryRequest(request_id=request_id, entry=entry)
        )
        return resp

    async def lookup(
        self,
        *,
        tenant: str,
        model: str,
        conversation_key: str,
        block_hashes: Sequence[bytes],
        block_size: int,
        min_tokens: int = 0,
    ) -> pb.LookupEntryResponse:
        req = lookup_request(tenant, model, conversation_key, block_hashes, block_size, min_tokens)
        resp: pb.LookupEntryResponse = await self._unary("LookupEntry", req)
        return resp

    async def get_entry(self, tenant: str, model: str, conversation_key: str) -> pb.Entry:
        key = pb.EntryKey(tenant=tenant, model=model, conversation_key=conversation_key)
        resp: pb.GetEntryResponse = await self._unary("GetEntry", pb.GetEntryRequest(key=key))
        return resp.entry

    async def list_entries(
        self, tenant: str = "", model: str = "", engine_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> pb.ListEntriesResponse:
        req = pb.ListEntriesRequest(
            tenant=tenant, model=model, engine_id=engine_id, page_size=page_size, page_token=page_token
        )
        resp: pb.ListEntriesResponse = await self._unary("ListEntries", req)
        return resp

    async def delete_entry(
        self, tenant: str, model: str, conversation_key: str, reason: int = types_pb2.REVOKE_REASON_OPERATOR
    ) -> pb.Entry:
        key = pb.EntryKey(tenant=tenant, model=model, conversation_key=conversation_key)
        resp: pb.DeleteEntryResponse = await self._unary(
            "DeleteEntry",
            pb.DeleteEntryRequest(key=key, reason=reason),  # type: ignore[arg-type]
        )
        return resp.entry
