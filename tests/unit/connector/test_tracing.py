"""Connector spans at a real OTLP/gRPC receiver, driven through the scheduler half's vLLM hooks.

The schedulers are the real ``KvbridgeConnectorScheduler`` (real vLLM config, no model weights);
requests are minimal stand-ins for ``vllm.v1.request.Request``. The turn's trace context comes
from the gateway's own kv_transfer_params builders, as in production. D registers with a real
registry and lease manager over loopback gRPC, whose server spans join the connector's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider

from kvbridge import telemetry as tel
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge_connector import tracing
from kvbridge_connector.params import ConversationRef
from kvbridge_connector.pulls import FinishedPull
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_connector.tracing import ConnectorTracer
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.telemetry import Telemetry, TelemetrySettings
from kvbridge_services.gateway import kvparams
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.fixtures.common import VLLM_HINT, require, wait_leader
from tests.fixtures.otlp_receiver import OtlpReceiver, ReceivedSpan, running_receiver

from .real_scheduler import BLOCK, BYTES_PER_TOKEN, FakeRequest, scheduler

require("vllm", VLLM_HINT)

TENANT = "acme-tenant"
CONVERSATION = "conv-private-key"  # neither string is hex: a 16-hex-char hash cannot contain it
HASH_KEY = bytes.fromhex("cd" * 32)
SECRET = b"unit-hash-secret-0123456789abcdef".hex()  # the deployment secret is hex (kvbridge.secret)
CLIENT, SERVER = trace_pb2.Span.SPAN_KIND_CLIENT, trace_pb2.Span.SPAN_KIND_SERVER
STATUS_ERROR = 2
GRANT = "kvbridge.lease.v1.LeaseService/GrantLease"
REGISTER = "kvbridge.registry.v1.RegistryService/RegisterEntry"


# ---- the turn's trace (what the gateway's turn span would be) ---------------------------------
ROOT_TRACER = TracerProvider().get_tracer("test-gateway")


@contextlib.contextmanager
def turn_span() -> Iterator[trace.SpanContext]:
    with ROOT_TRACER.start_as_current_span("kvbridge.gateway.turn") as span:
        yield span.get_span_context()


def tid(ctx: trace.SpanContext) -> bytes:
    return ctx.trace_id.to_bytes(16, "big")


def sid(ctx: trace.SpanContext) -> bytes:
    return ctx.span_id.to_bytes(8, "big")


async def spans_after_flush(
    receiver: OtlpReceiver,
    flushers: list[Callable[[], object]],
    predicate: Callable[[list[ReceivedSpan]], bool],
    timeout_s: float = 20.0,
) -> list[ReceivedSpan]:
    """Flushes the exporters (off the loop: they wait for this loop's receiver) until ``predicate`` holds."""
    async with asyncio.timeout(timeout_s):
        while True:
            for flush in flushers:
                await asyncio.to_thread(flush)
            if predicate(receiver.spans()):
                return receiver.spans()
            await asyncio.sleep(0.1)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with running_receiver() as r:
        yield r


# ---- prefill: pulls and declines ----------------------------------------------------------------
PROMPT = list(range(10, 210))


def _pull_params(tokens: int) -> dict[str, Any]:
    source = kvparams.PullSource(
        engine_id="decode-0",
        request_id="d-req-1",
        host="127.0.0.1",
        port=5600,
        block_groups=[list(range(1, 9))],
        offer_window_s=5.0,
        looked_up_at=time.monotonic(),
    )
    return kvparams.reuse_prefill_params(source, tokens, BLOCK, prompt_ids=PROMPT, secret=bytes.fromhex(SECRET))


def named(spans: list[ReceivedSpan], name: str, request_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name and s.attributes.get(tracing.ATTR_REQUEST) == request_id]


async def test_prefill_pull_spans_continue_the_turn_trace(vllm_configs: dict[str, Any], receiver: OtlpReceiver) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    with scheduler(
        vllm_configs, "kv_producer", {"kvbridge_otlp_endpoint": receiver.endpoint, "kvbridge_hash_secret": SECRET}
    ) as sched:
        assert sched.tracer.enabled
        with turn_span() as turn:
            ok = FakeRequest("p-ok", _pull_params(96), PROMPT)
            bad = FakeRequest("p-bad", _pull_params(96), PROMPT)
            small = FakeRequest("p-small", _pull_params(32), PROMPT)
            cached = FakeRequest("p-cached", _pull_params(96), PROMPT)
        assert ok.kv_transfer_params[tel.KV_PARAMS_TRACEPARENT].split("-")[1] == f"{turn.trace_id:032x}"
        assert sched.get_num_new_matched_tokens(ok, 0) == (96, True)
        assert sched.get_num_new_matched_tokens(ok, 0) == (96, True)  # vLLM may ask again: one pull
        assert sched.get_num_new_matched_tokens(bad, 0) == (96, True)
        assert sched.get_num_new_matched_tokens(small, 0) == (0, False)  # below kv_recompute_threshold (64)
        assert sched.get_num_new_matched_tokens(small, 0) == (0, False)  # asked again: one decline span
        assert sched.get_num_new_matched_tokens(cached, 96) == (0, False)  # P's own prefix cache has it
        sched.update_connector_output(KVConnectorOutput(finished_recving={"p-ok", "p-bad"}, failed_recving={"p-bad"}))
        # The failed read-back is asked again by vLLM: the connector recomputes instead.
        bad.kv_transfer_params["_remote_blocks_processed"] = True
        assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)
        spans = await spans_after_flush(
            receiver, [sched.tracer.force_flush], lambda s: len([x for x in s if x.name == tracing.SPAN_PULL]) >= 5
        )

    pulls = [s for s in spans if s.name == tracing.SPAN_PULL]
    assert len(pulls) == 5, [(s.attributes[tracing.ATTR_REQUEST], s.attributes[tel.ATTR_REASON]) for s in pulls]
    for span in pulls:
        assert (span.trace_id, span.parent_span_id) == (tid(turn), sid(turn))
        assert span.service == "kvbridge-connector"
        assert span.attributes[tel.ATTR_ENGINE] == "prefill-0"
        assert span.attributes[tracing.ATTR_SOURCE_ENGINE] == "decode-0"
    (good,) = named(pulls, tracing.SPAN_PULL, "p-ok")
    assert good.kind == CLIENT and good.status_code != STATUS_ERROR
    assert good.attributes[tel.ATTR_PULLED_TOKENS] == 96
    assert good.attributes[tracing.ATTR_PULL_BLOCKS] == 3
    assert good.attributes[tel.ATTR_PULL_BYTES] == 96 * BYTES_PER_TOKEN
    assert good.attributes[tracing.ATTR_OUTCOME] == "ok" and good.attributes[tel.ATTR_VERDICT] == "pulled"
    assert good.end_ns >= good.start_ns
    assert abs((good.end_ns - good.start_ns) / 1e9 - good.attributes[tel.ATTR_PULL_SECONDS]) < 1e-3
    failed, retry = sorted(named(pulls, tracing.SPAN_PULL, "p-bad"), key=lambda s: s.start_ns)
    assert failed.status_code == STATUS_ERROR and failed.attributes[tracing.ATTR_OUTCOME] == "failed"
    assert failed.attributes[tel.ATTR_PULL_BYTES] == 0
    assert retry.attributes[tel.ATTR_REASON] == "read_back_already_attempted"
    reasons = {
        s.attributes[tracing.ATTR_REQUEST]: s.attributes[tel.ATTR_REASON]
        for s in pulls
        if s.attributes[tracing.ATTR_OUTCOME] == "declined"
    }
    assert reasons == {
        "p-small": "below_recompute_threshold",
        "p-cached": "local_prefix_cache",
        "p-bad": "read_back_already_attempted",
    }


async def test_vllm_trace_headers_are_the_fallback_parent(vllm_configs: dict[str, Any], receiver: OtlpReceiver) -> None:
    """Without the gateway's field, a traceparent vLLM kept from the HTTP headers parents the span."""
    from vllm.v1.outputs import KVConnectorOutput

    with scheduler(
        vllm_configs, "kv_producer", {"kvbridge_otlp_endpoint": receiver.endpoint, "kvbridge_hash_secret": SECRET}
    ) as sched:
        params = _pull_params(96)
        params.pop(tel.KV_PARAMS_TRACEPARENT, None)
        with turn_span() as turn:
            headers = tel.trace_headers()
        request = FakeRequest("p-headers", params, PROMPT, trace_headers=headers)
        assert sched.get_num_new_matched_tokens(request, 0) == (96, True)
        sched.update_connector_output(KVConnectorOutput(finished_recving={"p-headers"}))
        spans = await spans_after_flush(
            receiver, [sched.tracer.force_flush], lambda s: any(x.name == tracing.SPAN_PULL for x in s)
        )
    (span,) = spans
    assert (span.trace_id, span.parent_span_id) == (tid(turn), sid(turn))


# ---- decode: registration ------------------------------------------------------------------------
@dataclass
class ControlPlaneApps:
    registry: RegistryApp
    lease: LeaseApp
    telemetries: list[Telemetry]


@pytest.fixture
async def control_plane(receiver: OtlpReceiver) -> AsyncIterator[ControlPlaneApps]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    settings = TelemetrySettings(hash_key_hex=HASH_KEY.hex())
    reg_tel, lease_tel = (
        Telemetry.from_env(name, env, settings=settings) for name in ("kvbridge-registry", "kvbridge-lease")
    )
    store = MemoryStore()
    lease = LeaseApp(
        store,
        LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
        ServerSettings(shutdown_grace_s=0.2),
        telemetry=lease_tel,
    )
    await lease.start()
    await wait_leader(lease)
    registry = RegistryApp(
        store,
        settings=RegistrySettings(port=0, lease_service_target=lease.address),
        server_settings=ServerSettings(shutdown_grace_s=0.2),
        telemetry=reg_tel,
    )
    await registry.start()
    try:
        yield ControlPlaneApps(registry, lease, [reg_tel, lease_tel])
    finally:
        await registry.stop(0.1)
        await lease.stop(0.1)
        await store.close()
        for t in (reg_tel, lease_tel):
            await asyncio.to_thread(t.shutdown)


async def _wait_engine_registered(registry_target: str, engine_id: str) -> None:
    async with grpc.aio.insecure_channel(registry_target) as channel, asyncio.timeout(20):
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while True:
            try:
                await stub.GetEngine(registry_pb2.GetEngineRequest(engine_id=engine_id), timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)


async def test_decode_registration_span_joins_the_turn_and_the_services(
    vllm_configs: dict[str, Any],
    receiver: OtlpReceiver,
    control_plane: ControlPlaneApps,
) -> None:
    extra = {
        "kvbridge_registry": control_plane.registry.address,
        "kvbridge_lease": control_plane.lease.address,
        "kvbridge_hash_secret": SECRET,
        "kvbridge_model": "tiny",
        "kvbridge_otlp_endpoint": receiver.endpoint,
        "kvbridge_telemetry_hash_key_hex": HASH_KEY.hex(),
    }
    with scheduler(vllm_configs, "kv_consumer", extra) as sched:
        await _wait_engine_registered(control_plane.registry.address, "decode-0")
        with turn_span() as turn:
            params = kvparams.decode_params(
                {"do_remote_prefill": False, "do_remote_decode": False},
                tenant=TENANT,
                conversation_key=CONVERSATION,
                epoch=1,
                secret=bytes.fromhex(SECRET),
            )
        request = FakeRequest(
            "d-req-1", params, list(range(10, 110)), num_computed_tokens=128, output_token_ids=list(range(300, 340))
        )
        delay_free, returned = sched.request_finished(request, ([1, 2, 3, 4],))
        assert delay_free and returned is not None and returned["kvbridge_retained"] is True

        def complete(spans: list[ReceivedSpan]) -> bool:
            names = {(s.name, s.kind) for s in spans}
            return {
                (tracing.SPAN_REGISTER, trace_pb2.Span.SPAN_KIND_INTERNAL),
                (GRANT, SERVER),
                (REGISTER, SERVER),
            } <= names

        flushers = [sched.tracer.force_flush, *(t.force_flush for t in control_plane.telemetries)]
        spans = await spans_after_flush(receiver, flushers, complete)

    (register,) = [s for s in spans if s.name == tracing.SPAN_REGISTER]
    assert (register.trace_id, register.parent_span_id) == (tid(turn), sid(turn))
    attrs = register.attributes
    assert attrs[tel.ATTR_TENANT] == tel.hash_attribute(TENANT, HASH_KEY)
    assert attrs[tel.ATTR_CONVERSATION] == tel.hash_attribute(CONVERSATION, HASH_KEY)
    assert attrs[tracing.ATTR_RETAINED_TOKENS] == 128 and attrs[tracing.ATTR_RETAINED_BLOCKS] == 4
    assert attrs[tracing.ATTR_OUTCOME] == "registered" and attrs[tracing.ATTR_LEASE_ID] > 0
    assert attrs[tel.ATTR_ENGINE] == "decode-0" and attrs[tracing.ATTR_EPOCH] == 1
    # Connector CLIENT span per RPC under the registration, the service's SERVER span under it.
    for method in (GRANT, REGISTER):
        (client,) = [s for s in spans if s.name == method and s.kind == CLIENT and s.service == "kvbridge-connector"]
        assert (client.trace_id, client.parent_span_id) == (register.trace_id, register.span_id)
        (server,) = [s for s in spans if s.name == method and s.kind == SERVER and s.trace_id == register.trace_id]
        assert server.parent_span_id == client.span_id
    raw = receiver.raw()
    assert TENANT.encode() not in raw and CONVERSATION.encode() not in raw


# ---- off and failing ---------------------------------------------------------------------------------
def test_tracing_is_off_unless_configured() -> None:
    assert not ConnectorSettings.from_extra_config({}, env={}).tracing_enabled
    assert ConnectorSettings.from_extra_config({}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}).tracing_enabled
    assert ConnectorSettings.from_extra_config({}, env={"OTEL_TRACES_EXPORTER": "otlp"}).otlp_endpoint == ""
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}
    assert not ConnectorSettings.from_extra_config({}, env=off).tracing_enabled
    assert ConnectorSettings.from_extra_config({"kvbridge_otlp_endpoint": "http://x:4317"}, env={}).tracing_enabled
    tracer = ConnectorTracer.from_settings(ConnectorSettings(), "e0")
    assert not tracer.enabled and tracer.rpc_metadata() == ()
    with pytest.raises(ValueError, match=r"16\.\.64 bytes"):
        ConnectorSettings.from_extra_config({"kvbridge_telemetry_hash_key_hex": "abcd"}, env={})


class BrokenTracer:
    """An OpenTelemetry tracer whose every call fails."""

    def start_span(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError("exporter exploded")

    start_as_current_span = start_span


CONV = ConversationRef(tenant=TENANT, model="tiny", conversation_key=CONVERSATION, epoch=1)


def test_tracing_failures_never_reach_vllm_or_the_control_plane() -> None:
    tracer = ConnectorTracer(BrokenTracer(), engine_id="e0")
    request = FakeRequest("r1", _pull_params(96), list(range(200)))
    tracer.pull_finished(FinishedPull("r1", "d0", 96, 3, 1, 0.1, 1, 2, False, ()))
    tracer.pull_declined(request, "local_prefix_cache", 96)  # type: ignore[arg-type]
    with tracer.registration("r1", CONV, blocks=1, tokens=32, parent=(), submitted_ns=1) as span:
        span.set("k", 1)
        ran = True
    assert ran
    # The body's own errors still surface unchanged (the control plane logs and handles them).
    with pytest.raises(KeyError), tracer.registration("r1", CONV, blocks=1, tokens=32, parent=(), submitted_ns=1):
        raise KeyError("grant failed")
