"""What generic gRPC tools ask every server: reflection (v1 and v1alpha) and health (Check, Watch, List).

grpcurl, Postman and evans list and describe services through reflection, trying ``grpc.reflection.v1`` first;
grpcio-reflection only ships ``v1alpha``. The v1 protocol is v1alpha renamed (same messages, fields and
numbers), so the v1alpha servicer answers v1 too with the same wire bytes, served under the v1 method name;
the v1 file descriptor (built from v1alpha's by renaming its package) goes into the default pool so that v1
can be described like any other service.

grpcio-health-checking's servicer answers ``Check`` and ``Watch`` but not ``List``; ``ListingHealthServicer``
adds it (the statuses of every name set on it, at most ``MAX_LISTED``, as grpc's health protocol asks).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

REFLECTION_V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
# grpc's health protocol: List answers RESOURCE_EXHAUSTED above this many services.
MAX_LISTED = 100


@functools.cache
def _add_v1_descriptor() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default pool (once; kept if something else did)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileContainingSymbol(REFLECTION_V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()  # v1alpha's language options (java/go packages) name v1alpha
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> tuple[str, ...]:
    """Serves reflection v1 and v1alpha for ``service_names`` (plus both reflection services); returns the names."""
    _add_v1_descriptor()
    names = (*service_names, REFLECTION_V1, REFLECTION_V1ALPHA)
    servicer = reflection.aio.ReflectionServicer(names)  # ServerReflectionInfo: an async generator
    for service in (REFLECTION_V1, REFLECTION_V1ALPHA):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
    return names


def _list_response(statuses: Mapping[str, Any]) -> health_pb2.HealthListResponse:
    return health_pb2.HealthListResponse(
        statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
    )


class ListingHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpcio-health-checking's aio servicer plus ``List``: every name set on it ("" is the whole server)."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)
        if len(statuses) > MAX_LISTED:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(statuses)} services exceed the {MAX_LISTED} that List may answer",
            )
        return _list_response(statuses)
