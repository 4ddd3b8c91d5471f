"""A real multi-turn run (gateway + registry + lease manager + engine simulators) observed from outside:
spans at a real OTLP/gRPC receiver, linked across services; /metrics of registry and gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvbridge import telemetry as tel
from kvbridge_services.common.auth import Authenticator, Principal
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.telemetry import Telemetry, TelemetrySettings
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings, StaticEngine
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.fixtures.common import free_port, wait_leader
from tests.fixtures.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.tools.engine_sim import SimConfig, SimServer

MODEL = "sim-model"
BLOCK = 16
SECRET_HEX = "00112233445566778899aabbccddeeff"
TENANT = "acme"
CONVERSATION = "conv-private-key"  # neither string is hex: a hash can never contain it by chance
LONG = " ".join(f"word{i}" for i in range(120))
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT
LOOKUP = "kvbridge.registry.v1.RegistryService/LookupEntry"


@dataclass(frozen=True)
class SentRequest:
    method: str
    url: str
    headers: Mapping[str, str]


@dataclass
class Observed:
    receiver: OtlpReceiver
    gateway: GatewayApp
    registry: RegistryApp
    telemetries: list[Telemetry]
    client: httpx.AsyncClient
    engine_requests: list[SentRequest]

    async def flush(self) -> None:
        # Off the event loop: the exporter blocks until the receiver (on this loop) answers.
        for t in self.telemetries:
            assert await asyncio.to_thread(t.force_flush, 10_000)


@pytest.fixture
async def observed() -> AsyncIterator[Observed]:
    receiver = OtlpReceiver()
    await receiver.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    settings = TelemetrySettings(hash_key_hex="ab" * 32)
    gw_tel, reg_tel, lease_tel = (
        Telemetry.from_env(name, env, settings=settings)
        for name in ("kvbridge-gateway", "kvbridge-registry", "kvbridge-lease")
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
        settings=RegistrySettings(port=0, lease_service_target=lease.address, metrics_port=free_port()),
        server_settings=ServerSettings(shutdown_grace_s=0.2),
        telemetry=reg_tel,
    )
    await registry.start()
    p = SimServer(SimConfig(role="prefill", engine_id="p0", model=MODEL, block_size=BLOCK))
    d = SimServer(SimConfig(role="decode", engine_id="d0", model=MODEL, block_size=BLOCK))
    await p.__aenter__()
    await d.__aenter__()
    gw = GatewayApp(
        GatewaySettings(
            host="127.0.0.1",
            http_port=0,
            grpc_port=0,
            registry_address=registry.address,
            lease_address=lease.address,
            hash_secret_hex=SECRET_HEX,
            default_block_size=BLOCK,
            prefill_engines=[
                StaticEngine(
                    url=p.url,
                    model=MODEL,
                    engine_id="p0",
                    kv_host="127.0.0.1",
                    kv_port=p.cfg.port,
                    block_size=BLOCK,
                    register_in_registry=True,
                )
            ],
            decode_engines=[
                StaticEngine(
                    url=d.url,
                    model=MODEL,
                    engine_id="d0",
                    kv_host="127.0.0.1",
                    kv_port=d.cfg.port,
                    block_size=BLOCK,
                    register_in_registry=True,
                )
            ],
            engines_from_registry=False,
            health_interval_s=0.5,
        ),
        auth=Authenticator({"key-acme": Principal("acme-app", TENANT)}),
        telemetry=gw_tel,
    )
    await gw.start()
    sent: list[SentRequest] = []
    # What the gateway really sends to the engines.
    gw.core.http.observers.append(lambda method, url, headers: sent.append(SentRequest(method, url, headers)))
    client = httpx.AsyncClient(base_url=gw.http_url, headers={"authorization": "Bearer key-acme"}, timeout=30)
    try:
        yield Observed(receiver, gw, registry, [gw_tel, reg_tel, lease_tel], client, sent)
    finally:
        await client.aclose()
        await gw.stop()
        await d.__aexit__(None, None, None)
        await p.__aexit__(None, None, None)
        await registry.stop(0.1)
        await lease.stop(0.1)
        await store.close()
        for t in (gw_tel, reg_tel, lease_tel):
            await asyncio.to_thread(t.shutdown)
        await receiver.stop()


async def _turn(o: Observed, messages: list[dict[str, str]], *, stream: bool = False) -> tuple[str, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "conversation_id": CONVERSATION, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = await o.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    await o.gateway.core.router.drain()
    return (r.text if stream else str(r.json()["choices"][0]["message"]["content"])), r.headers["x-kvbridge-reuse"]


async def _run_turns(o: Observed) -> list[str]:
    """Five turns of one conversation: the first (new: the gateway's copy of the registry vouches that there is
    no entry), two hits, a streamed hit (it consumes the single-use entry and registers none), and a plain turn
    that finds no entry and, its conversation known, asks the registry."""
    mirror = o.gateway.core.mirror
    assert mirror is not None
    async with asyncio.timeout(10):
        while not mirror.in_sync():  # noqa: ASYNC110 - polling another component
            await asyncio.sleep(0.02)
    msgs = [{"role": "user", "content": LONG}]
    verdicts: list[str] = []
    for i in range(3):
        answer, verdict = await _turn(o, msgs)
        verdicts.append(verdict)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}"}]
    _, verdict = await _turn(o, msgs, stream=True)
    verdicts.append(verdict)
    _, verdict = await _turn(o, [*msgs, {"role": "assistant", "content": "w11"}, {"role": "user", "content": "last"}])
    verdicts.append(verdict)
    return verdicts


def _by_trace(spans: list[ReceivedSpan]) -> dict[bytes, list[ReceivedSpan]]:
    out: dict[bytes, list[ReceivedSpan]] = {}
    for s in spans:
        out.setdefault(s.trace_id, []).append(s)
    return out


async def test_one_linked_trace_per_turn_across_services(observed: Observed) -> None:
    o = observed
    verdicts = await _run_turns(o)
    assert verdicts[0].startswith("miss") and all(v.startswith("hit") for v in verdicts[1:3]), verdicts
    assert verdicts[4].startswith("miss"), verdicts
    await o.flush()
    # The last turn asks the registry; the others are answered by the gateway's entry mirror.
    spans = await o.receiver.wait_for(
        lambda ss: (
            sum(s.name == "kvbridge.gateway.turn" for s in ss) >= 5
            and any(s.name == LOOKUP and s.kind == SERVER for s in ss)
        )
    )

    roots = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert len(roots) == 5 and all(r.parent_span_id == b"" and r.kind == SERVER for r in roots)
    traces = _by_trace(spans)
    gateway_hash = Telemetry.from_env("x", {}, settings=TelemetrySettings(hash_key_hex="ab" * 32))
    for n, root in enumerate(roots):
        in_trace = traces[root.trace_id]
        ids = {s.span_id: s for s in in_trace}
        turn = next(s for s in in_trace if s.name == "kvbridge.gateway.turn")
        assert turn.parent_span_id == root.span_id and turn.service == "kvbridge-gateway"
        # A new conversation's turn is not tokenized (nothing to look up); the others ask P's /tokenize.
        assert any(s.name == "kvbridge.gateway.tokenize" for s in in_trace) == (n > 0)
        for step in ("kvbridge.gateway.tokenize", "kvbridge.gateway.prefill", "kvbridge.gateway.decode")[n == 0 :]:
            child = next(s for s in in_trace if s.name == step)
            assert child.parent_span_id == turn.span_id and child.kind == CLIENT, step
        # Gateway → registry: the registry's server span is the child of the gateway's client span. A lookup
        # the gateway's entry mirror answered has no registry span, and says so.
        source = turn.attributes[tel.ATTR_LOOKUP_SOURCE]
        reg_server = next((s for s in in_trace if s.name == LOOKUP and s.kind == SERVER), None)
        if source == "mirror":
            assert reg_server is None and verdicts[n].startswith("hit" if n else "miss")
        else:
            assert source == "registry" and reg_server is not None
            gw_client = ids[reg_server.parent_span_id]
            assert reg_server.service == "kvbridge-registry" and gw_client.service == "kvbridge-gateway"
            assert gw_client.name == LOOKUP and gw_client.kind == CLIENT and gw_client.parent_span_id == turn.span_id
            assert reg_server.attributes[tel.ATTR_TENANT] == gateway_hash.hash(TENANT)
        if n in (0, 4):  # the new conversation: the copy vouched; the last turn: no entry, a known conversation
            assert source == ("mirror" if n == 0 else "registry"), (n, source)
        # Gateway → lease manager (the compatibility-mode registration's lease grant), same trace. Streamed
        # turns register nothing, and per-turn renewals ride one long-lived KeepAlive stream outside any turn.
        lease_servers = [s for s in in_trace if s.service == "kvbridge-lease" and s.kind == SERVER]
        if n != 3:
            grant = next(s for s in lease_servers if s.name.endswith("/GrantLease"))
            assert ids[grant.parent_span_id].service == "kvbridge-gateway"
        assert not any(s.name.endswith("/KeepAlive") for s in lease_servers)
        # Attributes: hashed identity, verdict, tokens, engines.
        assert turn.attributes[tel.ATTR_TENANT] == gateway_hash.hash(TENANT)
        assert turn.attributes[tel.ATTR_CONVERSATION] == gateway_hash.hash(CONVERSATION)
        assert turn.attributes["kvbridge.prefill.engine_id"] == "p0"
        assert turn.attributes["kvbridge.decode.engine_id"] == "d0"
        expected = verdicts[n].split(";")[0].split(":")[0]
        assert turn.attributes[tel.ATTR_VERDICT] == expected
        # OpenTelemetry's GenAI conventions beside kvbridge's own (issue 31); a streamed turn's output tokens are
        # known only once its stream ended, after the turn's span.
        assert turn.attributes["gen_ai.operation.name"] == "chat"
        assert turn.attributes["gen_ai.system"] == "vllm"
        assert turn.attributes["gen_ai.request.model"] == MODEL
        assert turn.attributes["gen_ai.usage.input_tokens"] > len(LONG.split())
        assert turn.attributes.get("gen_ai.usage.output_tokens") == (None if n == 3 else 8)
        # The HTTP request's span has them too, a stream's usage included: it lasts until the stream's end.
        assert root.attributes["gen_ai.request.model"] == MODEL and root.attributes["gen_ai.operation.name"] == "chat"
        assert root.attributes["gen_ai.usage.output_tokens"] == 8
        assert root.attributes["gen_ai.usage.input_tokens"] == turn.attributes["gen_ai.usage.input_tokens"]
        assert root.end_ns >= turn.end_ns  # (a stream's usage is written at its end: the span was still open)
        # An engine call's server.address is a host, never a URL.
        for step in ("kvbridge.gateway.prefill", "kvbridge.gateway.decode"):
            call = next(s for s in in_trace if s.name == step)
            assert call.attributes["server.address"] == "127.0.0.1", call.attributes
            assert isinstance(call.attributes["server.port"], int) and call.attributes["server.port"] > 0
        if expected == "hit":
            pulled = int(verdicts[n].split("=")[1])
            assert turn.attributes[tel.ATTR_PULLED_TOKENS] == pulled > 0
            assert turn.attributes[tel.ATTR_VERIFIED_TOKENS] >= pulled
            assert turn.attributes["kvbridge.source.engine_id"] == "d0"
            if reg_server is not None:
                assert reg_server.attributes[tel.ATTR_VERDICT] == "hit"
    # Registrations after a turn (compatibility mode) belong to that turn's trace too.
    registers = [s for s in spans if s.name.endswith("/RegisterEntry") and s.kind == SERVER]
    assert registers and all(r.trace_id in {root.trace_id for root in roots} for r in registers)

    # traceparent went into every engine HTTP request, naming a span of the turn's trace.
    engine_calls = [r for r in o.engine_requests if r.method == "POST"]
    assert engine_calls and all("traceparent" in r.headers for r in engine_calls)
    root_traces = {r.trace_id.hex() for r in roots}
    assert {r.headers["traceparent"].split("-")[1] for r in engine_calls} == root_traces

    raw = o.receiver.raw()
    assert TENANT.encode() not in raw and CONVERSATION.encode() not in raw


async def _metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as c:
        r = await c.get(url)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def _total(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


async def test_metrics_endpoints_expose_nonzero_values_after_a_run(observed: Observed) -> None:
    o = observed
    await _run_turns(o)  # the last turn, plain after a streamed one, leaves an entry to count
    reg = await _metrics(o.registry.metrics_endpoint.url)
    assert reg["kvbridge_registry_entries{}"] >= 1
    assert reg["kvbridge_registry_entry_bytes{}"] > 0
    assert _total(reg, "kvbridge_registry_lookups_total{") >= 1  # the last turn's; hits may be the mirror's
    assert _total(reg, "kvbridge_registry_registrations_total{outcome=") >= 3
    assert "kvbridge_registry_lookup_verified_tokens_total{}" in reg  # > 0 only if a hit was the registry's
    assert reg["kvbridge_store_request_seconds_count{op=txn}"] > 0
    assert _total(reg, "kvbridge_grpc_server_handled_total{code=OK,method=/kvbridge.registry.v1") > 0

    gw = await _metrics(o.gateway.http_url + "/metrics")
    for scraped in (reg, gw):  # process_* on every service; no *_created series (issue 31)
        assert scraped["process_cpu_seconds_total{}"] > 0 and scraped["process_resident_memory_bytes{}"] > 0
        assert scraped["process_open_fds{}"] > 0 and scraped["process_start_time_seconds{}"] > 0
        assert not [name for name in scraped if "_created{" in name]
    assert gw["kvbridge_gateway_reuse_total{reason=,verdict=hit}"] >= 2
    assert _total(gw, "kvbridge_gateway_lookups_total{") >= 5  # every turn looked up, mirror or registry
    assert gw["kvbridge_gateway_reuse_total{reason=,verdict=miss}"] >= 1
    assert gw["kvbridge_gateway_verified_tokens_total{}"] > 0
    assert gw["kvbridge_gateway_pulled_tokens_total{}"] > 0
    assert gw["kvbridge_gateway_ttft_seconds_count{reuse=hit}"] >= 2
    assert gw["kvbridge_gateway_ttft_seconds_count{reuse=none}"] >= 1
    assert gw["kvbridge_gateway_router_overhead_seconds_count{}"] == 5
    assert gw["kvbridge_gateway_requests_total{route=chat,status=2xx}"] == 5
