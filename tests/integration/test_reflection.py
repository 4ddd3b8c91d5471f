"""gRPC server reflection (v1 and v1alpha) and health List on the registry, the lease manager and the gateway.

Each service runs in-process on a real loopback port (tests/fixtures/gateway_stack.py). The client is the one
grpcurl-like tools use: grpcio-reflection's ProtoReflectionDescriptorDatabase behind a DescriptorPool (list the
services, describe a method, resolve the file containing a symbol), pointed at v1alpha or at v1. It is a sync
client, so each use runs in a thread while the servers answer on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvbridge_services.common.store_space import STORE_HEALTH
from tests.fixtures.gateway_stack import Stack, running_stack

T = TypeVar("T")
V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
HEALTH = "grpc.health.v1.Health"


@dataclass(frozen=True)
class Target:
    name: str
    service: str
    method: str  # one to describe
    request_type: str
    client_streaming: bool
    server_streaming: bool
    symbol: str  # a message resolved with file_containing_symbol
    file: str  # the file that defines it


TARGETS = [
    Target(
        "registry",
        "kvbridge.registry.v1.RegistryService",
        "LookupEntry",
        "kvbridge.registry.v1.LookupEntryRequest",
        False,
        False,
        "kvbridge.registry.v1.Location",
        "kvbridge/registry/v1/registry.proto",
    ),
    Target(
        "lease",
        "kvbridge.lease.v1.LeaseService",
        "KeepAlive",
        "kvbridge.lease.v1.KeepAliveRequest",
        True,
        True,
        "kvbridge.lease.v1.LeaseStatus",
        "kvbridge/lease/v1/lease.proto",
    ),
    Target(
        "gateway",
        "kvbridge.gateway.v1.GatewayService",
        "CreateChatCompletion",
        "kvbridge.gateway.v1.CreateChatCompletionRequest",
        False,
        True,
        "kvbridge.gateway.v1.ChatMessage",
        "kvbridge/gateway/v1/gateway.proto",
    ),
]


class _V1Stub:
    """grpc.reflection.v1 with v1alpha's message classes: v1 is v1alpha renamed, the same bytes on the wire."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.ServerReflectionInfo = channel.stream_stream(
            f"/{V1}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )


def reflection_db(channel: grpc.Channel, version: str) -> ProtoReflectionDescriptorDatabase:
    db = ProtoReflectionDescriptorDatabase(channel)
    if version == "v1":
        db._stub = _V1Stub(channel)
    return db


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        yield s


def address(stack: Stack, name: str) -> str:
    assert stack.registry is not None and stack.lease is not None
    return {"registry": stack.registry.address, "lease": stack.lease.address, "gateway": stack.gateway.grpc_address}[
        name
    ]


async def in_thread(target: str, version: str, use: Callable[[ProtoReflectionDescriptorDatabase], T]) -> T:
    def run() -> T:
        with grpc.insecure_channel(target) as channel:
            return use(reflection_db(channel, version))

    return await asyncio.wait_for(asyncio.to_thread(run), 20)


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_lists_describes_and_resolves_on_every_service(stack: Stack, version: str) -> None:
    for t in TARGETS:

        def explore(db: ProtoReflectionDescriptorDatabase, t: Target = t) -> dict[str, Any]:
            pool = DescriptorPool(db)
            method = pool.FindServiceByName(t.service).FindMethodByName(t.method)
            symbol_file = db.FindFileContainingSymbol(t.symbol)
            return {
                "services": set(db.get_services()),
                "input": method.input_type.full_name,
                "fields": [f.name for f in method.input_type.fields],
                "streaming": (method.client_streaming, method.server_streaming),
                "symbol_file": symbol_file.name,
                "symbol_deps": list(symbol_file.dependency),
                # grpcurl resolves ErrorInfo through reflection to print an error's details.
                "error_info": [f.name for f in pool.FindMessageTypeByName("google.rpc.ErrorInfo").fields],
                # The reflection services describe themselves, v1 included.
                "v1_method": pool.FindServiceByName(V1).FindMethodByName("ServerReflectionInfo").input_type.full_name,
                "health_methods": sorted(m.name for m in pool.FindServiceByName(HEALTH).methods),
            }

        seen = await in_thread(address(stack, t.name), version, explore)
        assert seen["services"] == {t.service, HEALTH, V1, V1ALPHA}, t.name
        assert seen["input"] == t.request_type
        assert seen["fields"], t.name
        assert seen["streaming"] == (t.client_streaming, t.server_streaming), t.name
        assert seen["symbol_file"] == t.file
        assert "google/protobuf/timestamp.proto" in seen["symbol_deps"] or t.name == "gateway"
        assert seen["error_info"] == ["reason", "domain", "metadata"]
        assert seen["v1_method"] == "grpc.reflection.v1.ServerReflectionRequest"
        assert seen["health_methods"] == ["Check", "List", "Watch"]
    registry_fields = await in_thread(
        address(stack, "registry"),
        version,
        lambda db: [
            f.name for f in DescriptorPool(db).FindMessageTypeByName("kvbridge.registry.v1.LookupEntryRequest").fields
        ],
    )
    assert "conversation_key" in registry_fields and "block_hashes_packed" in registry_fields


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_not_found_for_an_unknown_symbol(stack: Stack, version: str) -> None:
    def ask(db: ProtoReflectionDescriptorDatabase) -> str:
        try:
            db.FindFileContainingSymbol("kvbridge.nope.v1.Missing")
        except KeyError as exc:
            return str(exc)
        return "found"

    answer = await in_thread(address(stack, "lease"), version, ask)
    assert "kvbridge.nope.v1.Missing" in answer


async def test_a_raw_reflection_stream_carries_several_requests(stack: Stack) -> None:
    """grpcurl keeps one stream open for all its questions: each request gets its own answer, in order."""
    async with grpc.aio.insecure_channel(address(stack, "registry")) as channel:
        call = channel.stream_stream(
            f"/{V1}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )

        def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(file_by_filename="kvbridge/types/v1/types.proto")
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvbridge.nope.v1.Missing")

        answers = [r async for r in call(requests(), timeout=10)]
    assert [a.WhichOneof("message_response") for a in answers] == [
        "list_services_response",
        "file_descriptor_response",
        "error_response",
    ]
    assert answers[2].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_health_list_reports_every_service_and_follows_changes(stack: Stack) -> None:
    assert stack.lease is not None and stack.registry is not None
    for t in TARGETS:
        async with grpc.aio.insecure_channel(address(stack, t.name)) as channel:
            listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
        liveness = {"liveness": health_pb2.HealthCheckResponse.SERVING} if t.name == "lease" else {}  # every replica
        # The services on the store say whether it takes writes (NOT_SERVING at etcd's NOSPACE alarm).
        space = {STORE_HEALTH: health_pb2.HealthCheckResponse.SERVING} if t.name in ("lease", "registry") else {}
        assert {name: s.status for name, s in listed.statuses.items()} == {
            "": health_pb2.HealthCheckResponse.SERVING,
            t.service: health_pb2.HealthCheckResponse.SERVING,
            **liveness,
            **space,
        }, t.name
    await stack.registry.server.health.set(TARGETS[0].service, health_pb2.HealthCheckResponse.NOT_SERVING)
    async with grpc.aio.insecure_channel(stack.registry.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
        checked = await stub.Check(health_pb2.HealthCheckRequest(service=TARGETS[0].service), timeout=5)
    assert listed.statuses[TARGETS[0].service].status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert listed.statuses[""].status == health_pb2.HealthCheckResponse.SERVING
    assert checked.status == health_pb2.HealthCheckResponse.NOT_SERVING
