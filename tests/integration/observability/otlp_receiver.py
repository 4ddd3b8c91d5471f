"""A real OTLP/gRPC trace receiver for tests: keeps every ExportTraceServiceRequest it is sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(0)

    def raw(self) -> bytes:
        return b"".join(r.SerializeToString() for r in self.requests)

    def spans(self) -> list[ReceivedSpan]:
        out: list[ReceivedSpan] = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(ReceivedSpan(str(resource.get("service.name")), s.name, s.kind, s.trace_id,
                                                s.span_id, s.parent_span_id,
                                                {a.key: _value(a.value) for a in s.attributes}))
        return out

    async def wait_for(self, predicate: Any, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        async with asyncio.timeout(timeout_s):
            while not predicate(self.spans()):  # noqa: ASYNC110 - polling the exporter's batches
                await asyncio.sleep(0.05)
        return self.spans()
