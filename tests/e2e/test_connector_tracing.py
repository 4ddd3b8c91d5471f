"""Connector spans from real vLLM engines: one turn's trace shows D's registration and P's pull.

Both engines run the kvbridge connector with the standard ``OTEL_*`` variables pointing at a
real OTLP/gRPC receiver in this test. The test plays the gateway: its own "turn" span is the
root, and the kv_transfer_params come from the gateway's builders, which add the turn's
``kvbridge_traceparent``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanContext

from kvbridge import telemetry as tel
from kvbridge_connector import tracing
from kvbridge_services.gateway import kvparams
from tests.e2e.conftest import HASH_SECRET, kvbridge_overrides
from tests.e2e.pd_client import E2E_SECRET, completion, random_tokens
from tests.e2e.test_kvbridge_pd import wait_for_entry
from tests.fixtures.control_plane_procs import ControlPlaneProcs
from tests.fixtures.otlp_receiver import OtlpReceiver, ReceivedSpan, running_receiver
from tests.fixtures.vllm_engines import BLOCK_SIZE, EnginePool, PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TENANT = "acme"
CONVERSATION = "conv-traced-turns"  # not hex: a hashed attribute can never contain it
HASH_KEY_HEX = "5a" * 32


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with running_receiver() as r:
        yield r


@pytest.fixture
async def traced_pd(
    engine_pool: EnginePool, request: pytest.FixtureRequest, receiver: OtlpReceiver
) -> AsyncIterator[tuple[PDEngines, ControlPlaneProcs]]:
    """kvbridge engines exporting connector spans to ``receiver``; stopped afterwards (the port dies with it)."""
    engine_pool.close()  # before the control plane starts: a control plane started beside engines took minutes
    control_plane: ControlPlaneProcs = request.getfixturevalue("control_plane")
    prefill, decode = kvbridge_overrides(control_plane)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "KVBRIDGE_TELEMETRY_HASH_KEY_HEX": HASH_KEY_HEX,
    }
    prefill["extra_env"] = dict(env, OTEL_SERVICE_NAME="kvbridge-connector-prefill")
    decode["extra_env"] = dict(env, OTEL_SERVICE_NAME="kvbridge-connector-decode")
    # Off the loop: the receiver keeps answering while the engines start.
    engines = await asyncio.to_thread(engine_pool.get, "kvbridge-tracing", prefill, decode)
    try:
        yield engines, control_plane
    finally:
        await asyncio.to_thread(engine_pool.close)


def _fields(epoch: int) -> dict[str, Any]:
    return {"tenant": TENANT, "conversation_key": CONVERSATION, "epoch": epoch, "secret": bytes.fromhex(HASH_SECRET)}


async def test_turn_two_trace_shows_decode_registration_and_prefill_pull(
    traced_pd: tuple[PDEngines, ControlPlaneProcs],
    receiver: OtlpReceiver,
) -> None:
    engines, control_plane = traced_pd
    prefill, decode = engines.prefill, engines.decode
    provider = TracerProvider(resource=Resource.create({"service.name": "e2e-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
    tracer = provider.get_tracer("e2e")
    rng = random.Random(41)
    prompt = random_tokens(rng, 150)

    # Turn 1: plain prefill, D retains and registers (epoch 1).
    with tracer.start_as_current_span("kvbridge.gateway.turn"):
        p_out = await asyncio.to_thread(completion, prefill, prompt, 1, kvparams.plain_prefill_params())
        d_params = kvparams.decode_params(p_out["kv_transfer_params"], **_fields(1))
        d_out = await asyncio.to_thread(completion, decode, prompt, 24, d_params)
    entry = await asyncio.to_thread(wait_for_entry, control_plane, CONVERSATION, 1)
    prompt = prompt + list(d_out["choices"][0]["token_ids"]) + random_tokens(rng, 40)

    # Turn 2: P pulls D's retained blocks (as the gateway would send them), D registers the next epoch.
    # NIXL's first handshake has a 5 s deadline that a loaded 2-core host can miss (P then recomputes and
    # the turn still answers): one more turn then pulls from the entry that turn registered.
    epoch = 1
    for _attempt in range(2):
        with tracer.start_as_current_span("kvbridge.gateway.turn") as root:
            turn: SpanContext = root.get_span_context()
            source = kvparams.PullSource(
                engine_id=entry.engine_id,
                request_id=entry.engine_request_id,
                host="127.0.0.1",
                port=decode.side_channel_port,
                block_groups=[list(g.ids) for g in entry.block_ids],
                offer_window_s=5.0,
                looked_up_at=time.monotonic(),
            )
            tokens = kvparams.reusable_tokens(entry.token_count, len(prompt), BLOCK_SIZE)
            p_out = await asyncio.to_thread(
                completion,
                prefill,
                prompt,
                1,
                kvparams.reuse_prefill_params(source, tokens, BLOCK_SIZE, prompt_ids=prompt, secret=E2E_SECRET),
            )
            d_params = kvparams.decode_params(p_out["kv_transfer_params"], **_fields(epoch + 1))
            d_out = await asyncio.to_thread(completion, decode, prompt, 24, d_params)
        epoch += 1
        entry = await asyncio.to_thread(wait_for_entry, control_plane, CONVERSATION, epoch)
        if p_out["kv_transfer_params"].get("remote_prefill_cached_tokens") == tokens:
            break
        prompt = prompt + list(d_out["choices"][0]["token_ids"]) + random_tokens(rng, 40)
    else:
        pytest.fail("P did not pull D's blocks in two turns")
    assert await asyncio.to_thread(provider.force_flush, 10_000)

    trace_id = turn.trace_id.to_bytes(16, "big")
    root_id = turn.span_id.to_bytes(8, "big")

    def in_turn(name: str, service: str) -> Callable[[list[ReceivedSpan]], bool]:
        return lambda spans: any(s.trace_id == trace_id and s.name == name and s.service == service for s in spans)

    await receiver.wait_for(in_turn(tracing.SPAN_PULL, "kvbridge-connector-prefill"), timeout_s=60)
    spans = await receiver.wait_for(in_turn(tracing.SPAN_REGISTER, "kvbridge-connector-decode"), timeout_s=60)
    turn_spans = [s for s in spans if s.trace_id == trace_id]
    (root_span,) = [s for s in turn_spans if s.span_id == root_id]
    assert root_span.service == "e2e-gateway"
    (pull,) = [s for s in turn_spans if s.name == tracing.SPAN_PULL]
    assert pull.parent_span_id == root_id and pull.service == "kvbridge-connector-prefill"
    assert pull.attributes[tracing.ATTR_OUTCOME] == "ok"
    assert pull.attributes[tel.ATTR_PULLED_TOKENS] == tokens
    assert pull.attributes[tracing.ATTR_SOURCE_ENGINE] == decode.engine_id
    assert pull.attributes[tracing.ATTR_PULL_BLOCKS] == tokens // BLOCK_SIZE
    assert pull.attributes[tel.ATTR_PULL_BYTES] > 0 and pull.end_ns > pull.start_ns
    (register,) = [s for s in turn_spans if s.name == tracing.SPAN_REGISTER]
    assert register.parent_span_id == root_id and register.service == "kvbridge-connector-decode"
    assert register.attributes[tracing.ATTR_OUTCOME] == "registered"
    assert register.attributes[tracing.ATTR_EPOCH] == epoch
    key = bytes.fromhex(HASH_KEY_HEX)
    assert register.attributes[tel.ATTR_CONVERSATION] == tel.hash_attribute(CONVERSATION, key)
    rpcs = {s.name for s in turn_spans if s.parent_span_id == register.span_id}
    assert rpcs == {"kvbridge.lease.v1.LeaseService/GrantLease", "kvbridge.registry.v1.RegistryService/RegisterEntry"}
    assert CONVERSATION.encode() not in receiver.raw()
    provider.shutdown()
