"""A scripted GatewayService (and a scripted LeaseService KeepAlive) on a real loopback gRPC server: each
call takes the next step of a script (fail with a typed error, stream some chunks then fail, or succeed), so
the SDK's retry rules can be checked call by call. Errors go out through the services' real boundary translation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvbridge.errors import KvbridgeError
from kvbridge.gateway.v1 import gateway_pb2 as pb
from kvbridge.gateway.v1 import gateway_pb2_grpc as pb_grpc
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.boundary import rpc_boundary, stream_boundary


@dataclass
class Step:
    chunks: int = 1  # chat chunks streamed before ``error`` (if any)
    error: KvbridgeError | None = None
    # Streams: wait this long between chunks (lets a test cancel mid-stream).
    pause_s: float = 0.0


@dataclass
class ScriptedGateway(pb_grpc.GatewayServiceServicer):
    script: list[Step] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0

    def _next(self, method: str, context: Any) -> Step:
        self.calls.append(method)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        return self.script.pop(0) if self.script else Step()

    @stream_boundary
    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Any
    ) -> AsyncIterator[pb.CreateChatCompletionResponse]:
        step = self._next("CreateChatCompletion", context)
        try:
            for i in range(step.chunks):
                if i and step.pause_s:
                    await asyncio.sleep(step.pause_s)
                yield pb.CreateChatCompletionResponse(
                    id="c1", model=request.model, delta_content=f"t{i} ", delta_token_ids=[i]
                )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if step.error is not None:
            raise step.error

    @stream_boundary
    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Any
    ) -> AsyncIterator[pb.CreateCompletionResponse]:
        self._next("CreateCompletion", context)
        yield pb.CreateCompletionResponse(id="t1", model=request.model, delta_text="w10")

    @rpc_boundary
    async def CloseConversation(
        self, request: pb.CloseConversationRequest, context: Any
    ) -> pb.CloseConversationResponse:
        self._next("CloseConversation", context)
        return pb.CloseConversationResponse(released=True)

    @rpc_boundary
    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        step = self._next("ListModels", context)
        if step.error is not None:
            raise step.error
        return pb.ListModelsResponse(models=[pb.Model(id="m")])


@dataclass
class Served:
    servicer: ScriptedGateway
    address: str


async def serve(servicer: ScriptedGateway) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def scripted() -> AsyncIterator[Served]:
    servicer = ScriptedGateway()
    server, address = await serve(servicer)
    yield Served(servicer, address)
    await server.stop(0)


@dataclass
class ScriptedLease(lease_pb2_grpc.LeaseServiceServicer):
    """KeepAlive only: each stream takes the next error of ``script`` (None: renew every id as alive)."""

    script: list[KvbridgeError | None] = field(default_factory=list)
    streams: int = 0
    renewals: int = 0

    @stream_boundary
    async def KeepAlive(
        self, request_iterator: AsyncIterator[lease_pb2.KeepAliveRequest], context: Any
    ) -> AsyncIterator[lease_pb2.KeepAliveResponse]:
        self.streams += 1
        error = self.script.pop(0) if self.script else None
        if error is not None:
            raise error
        async for request in request_iterator:
            self.renewals += 1
            response = lease_pb2.KeepAliveResponse()
            for lease_id in request.lease_ids:
                status = response.statuses.add(lease_id=lease_id, alive=True)
                status.ttl.FromSeconds(30)
            yield response

    async def _unscripted(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    GrantLease = RevokeLease = GetLease = ListLeases = _unscripted

    async def WatchLeases(
        self, request: lease_pb2.WatchLeasesRequest, context: Any
    ) -> AsyncIterator[lease_pb2.WatchLeasesResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")
        yield lease_pb2.WatchLeasesResponse()  # unreachable: makes this an async generator


async def serve_lease(servicer: ScriptedLease, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    lease_pb2_grpc.add_LeaseServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"
