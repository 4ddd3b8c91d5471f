"""GrpcServer.stop: health turns NOT_SERVING first, in-flight RPCs drain, then the server stops."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.server import GrpcServer, ServiceBinding

SERVICE = "test.Slow"


async def test_health_flips_to_not_serving_before_the_server_stops() -> None:
    release = asyncio.Event()

    async def slow(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await release.wait()
        return b"done"

    handler = grpc.method_handlers_generic_handler(SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(slow)})
    server = GrpcServer(
        ServerSettings(), 0, [ServiceBinding(SERVICE, None, lambda _s, srv: srv.add_generic_rpc_handlers((handler,)))]
    )
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        call: Any = channel.unary_unary(f"/{SERVICE}/Call")
        in_flight = asyncio.ensure_future(call(b"x"))
        await asyncio.sleep(0.1)  # the call is in the server now
        stopping = asyncio.ensure_future(server.stop(grace_s=30))
        async with asyncio.timeout(10):
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # NOT_SERVING was announced while the server still runs its in-flight RPC ...
        assert not stopping.done() and not in_flight.done()
        watch.cancel()
        release.set()
        # ... which then drains and completes normally; only then does stop return.
        assert await asyncio.wait_for(in_flight, 10) == b"done"
        await asyncio.wait_for(stopping, 10)
