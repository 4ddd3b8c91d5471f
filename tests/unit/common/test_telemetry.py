"""Telemetry plumbing: env switch, attribute hashing, server spans from W3C metadata, client propagation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbridge import telemetry as api_telemetry
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.metered_store import MeteredStore
from kvbridge_services.common.server import GrpcServer, ServiceBinding
from kvbridge_services.common.store.base import StoreUnavailable
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.telemetry import Telemetry, TelemetrySettings, client_interceptors, tracing_enabled

SERVICE = "test.Echo"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_tracing_is_off_unless_an_otlp_exporter_is_configured(env: dict[str, str], expected: bool) -> None:
    assert tracing_enabled(env) is expected
    assert Telemetry.from_env("svc", env, settings=TelemetrySettings()).exporting is expected


def test_service_name_from_otel_service_name() -> None:
    tel = Telemetry.from_env(
        "kvbridge-registry",
        {"OTEL_SERVICE_NAME": "reg-east"},
        exporter=InMemorySpanExporter(),
        settings=TelemetrySettings(),
    )
    with tel.tracer.start_as_current_span("x") as span:
        assert span.resource.attributes["service.name"] == "reg-east"  # type: ignore[attr-defined]


def test_identity_attributes_are_keyed_hashes_never_raw() -> None:
    key = bytes(range(32))
    settings = TelemetrySettings(hash_key_hex=key.hex())
    a = Telemetry.from_env("a", {}, settings=settings)
    b = Telemetry.from_env("b", {}, settings=settings)
    attrs = a.identity(tenant="acme", conversation_key="conv-1")
    assert attrs == b.identity(tenant="acme", conversation_key="conv-1")  # same key: same hash across services
    assert set(attrs) == {api_telemetry.ATTR_TENANT, api_telemetry.ATTR_CONVERSATION}
    assert all(len(v) == 16 and "acme" not in v and "conv" not in v for v in attrs.values())
    assert attrs[api_telemetry.ATTR_TENANT] != a.identity(tenant="acme2")[api_telemetry.ATTR_TENANT]
    other = Telemetry.from_env("c", {}, settings=TelemetrySettings(hash_key_hex=bytes(32).hex()))
    assert other.hash("acme") != a.hash("acme")  # keyed: no dictionary attack without the key
    assert a.identity(tenant="", conversation_key="") == {}


def _echo_binding() -> ServiceBinding:
    async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        if request == b"crash":
            raise RuntimeError("boom")
        return request

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        for _ in range(3):
            yield request

    async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(server_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )
    return ServiceBinding(SERVICE, None, lambda _s, server: server.add_generic_rpc_handlers((handler,)))


async def test_server_spans_continue_the_callers_trace_and_count_rpcs() -> None:
    exporter = InMemorySpanExporter()
    server_tel = Telemetry.from_env("server", {}, exporter=exporter)
    client_tel = Telemetry.from_env("client", {}, exporter=exporter)
    server = GrpcServer(ServerSettings(), 0, [_echo_binding()], telemetry=server_tel)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address, interceptors=client_interceptors()) as ch:
            unary: Any = ch.unary_unary(f"/{SERVICE}/Unary")
            stream: Any = ch.unary_stream(f"/{SERVICE}/Stream")
            bidi: Any = ch.stream_stream(f"/{SERVICE}/Bidi")
            with client_tel.tracer.start_as_current_span("caller") as caller:
                assert await unary(b"hi") == b"hi"
                assert [m async for m in stream(b"s")] == [b"s"] * 3
                call = bidi()
                await call.write(b"b1")
                await call.done_writing()
                assert await call.read() == b"b1"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unary(b"fail")
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError):
                    await unary(b"crash")
            # Outside any span: the server span starts a trace of its own.
            await unary(b"alone")
    finally:
        await server.stop(0)
    server_tel.force_flush()
    client_tel.force_flush()
    spans = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert [s.name for s in spans] == [f"{SERVICE}/{m}" for m in ("Unary", "Stream", "Bidi", "Unary", "Unary", "Unary")]
    ctx = caller.get_span_context()
    for s in spans[:5]:
        assert s.context.trace_id == ctx.trace_id
        assert s.parent is not None and s.parent.span_id == ctx.span_id
        assert s.resource.attributes.get("service.name") == "server"
    assert spans[5].context.trace_id != ctx.trace_id and spans[5].parent is None
    codes = [(s.attributes or {}).get("rpc.grpc.status_code") for s in spans]
    assert codes == [0, 0, 0, grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.UNKNOWN.value[0], 0]
    assert spans[3].status.is_ok  # a client error is not a server failure
    assert not spans[4].status.is_ok
    handled = server_tel.registry.get_sample_value(
        "kvbridge_grpc_server_handled_total", {"method": f"/{SERVICE}/Unary", "code": "OK"}
    )
    assert handled == 2


async def test_metered_store_times_calls_and_counts_errors() -> None:
    tel = Telemetry.disabled("s")
    store = MeteredStore(MemoryStore(), tel.registry)
    await store.put(b"/k", b"v")
    assert (await store.get(b"/k")) is not None
    assert tel.registry.get_sample_value("kvbridge_store_request_seconds_count", {"op": "put"}) == 1
    assert tel.registry.get_sample_value("kvbridge_store_request_seconds_count", {"op": "get"}) == 1

    class Down(MemoryStore):
        async def get(self, key: bytes, *, timeout: float = 5.0) -> Any:
            raise StoreUnavailable("down")

    broken = MeteredStore(Down(), store.metrics)  # one StoreMetrics per registry
    with pytest.raises(StoreUnavailable):
        await broken.get(b"/k")
    assert tel.registry.get_sample_value("kvbridge_store_errors_total", {"op": "get", "error": "StoreUnavailable"}) == 1
    await store.close()
    await broken.close()


def test_api_helpers_inject_and_extract_w3c_context() -> None:
    tel = Telemetry.from_env("x", {}, exporter=InMemorySpanExporter())
    assert api_telemetry.trace_headers() == {}
    with tel.tracer.start_as_current_span("parent") as parent:
        headers = api_telemetry.trace_headers()
        assert headers["traceparent"] == api_telemetry.current_traceparent()
    with api_telemetry.start_span("child", tracer=tel.tracer, parent=headers) as child:
        assert child.get_span_context().trace_id == parent.get_span_context().trace_id
        assert child.parent.span_id == parent.get_span_context().span_id
    carrier = api_telemetry.metadata_carrier([("traceparent", headers["traceparent"]), ("x-bin", b"\x00")])
    assert carrier == {"traceparent": headers["traceparent"]}


async def test_without_tracing_rpcs_get_no_span_but_are_still_counted() -> None:
    tel = Telemetry.from_env("server", {})
    assert not tel.tracing

    async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        return b"span" if trace.get_current_span().is_recording() else b"none"

    async def stream(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        yield b"span" if trace.get_current_span().is_recording() else b"none"

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {"Unary": grpc.unary_unary_rpc_method_handler(unary), "Stream": grpc.unary_stream_rpc_method_handler(stream)},
    )
    binding = ServiceBinding(SERVICE, None, lambda _s, server: server.add_generic_rpc_handlers((handler,)))
    server = GrpcServer(ServerSettings(), 0, [binding], telemetry=tel)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            call_unary: Any = ch.unary_unary(f"/{SERVICE}/Unary")
            call_stream: Any = ch.unary_stream(f"/{SERVICE}/Stream")
            assert [await call_unary(b"a"), await call_unary(b"b")] == [b"none", b"none"]
            assert [m async for m in call_stream(b"s")] == [b"none"]
            with pytest.raises(grpc.aio.AioRpcError):
                await call_unary(b"fail")
    finally:
        await server.stop(0)

    def handled(method: str, code: str) -> float | None:
        return tel.registry.get_sample_value(
            "kvbridge_grpc_server_handled_total", {"method": f"/{SERVICE}/{method}", "code": code}
        )

    assert (handled("Unary", "OK"), handled("Stream", "OK"), handled("Unary", "INVALID_ARGUMENT")) == (2, 1, 1)
    assert (
        tel.registry.get_sample_value("kvbridge_grpc_server_handling_seconds_count", {"method": f"/{SERVICE}/Unary"})
        == 3
    )
