"""Prometheus metrics of one gateway instance (in the service's own registry, so several can live in one process)."""

from __future__ import annotations

import hashlib

from prometheus_client import CollectorRegistry, generate_latest

from kvbridge_services.common.metric_factory import MetricFactory

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Fine below 10 ms, where a router's own time per turn should be (its percentiles are read from these bounds).
_OVERHEAD_BUCKETS = (
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1,
    2.5,
)


def engine_label(engine_id: str, url: str) -> str:
    """How /metrics names an engine: its engine id (the registry's, or the one it was configured with), else
    ``url-`` and 12 hex digits of its URL's SHA-256. Never the URL: /metrics is served without a key on the
    public HTTP port (docs/gateway.md, "Metrics"), and engines' addresses are not for tenants."""
    return engine_id or "url-" + hashlib.sha256(url.encode()).hexdigest()[:12]


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = MetricFactory(self.registry)
        self.requests = m.counter(
            "kvbridge_gateway_requests_total", "Client requests by route and status class", ["route", "status"]
        )
        self.reuse = m.counter(
            "kvbridge_gateway_reuse_total",
            "Turns by reuse verdict (hit, miss, declined) and the reason of a decline",
            ["verdict", "reason"],
        )
        self.keyless_threads = m.counter(
            "kvbridge_gateway_keyless_threads_total",
            "Turns without a conversation key, by how their thread was found: continues (this gateway's recent "
            "thread), forks (part of one), new",
            ["why"],
        )
        self.verified_tokens = m.counter(
            "kvbridge_gateway_verified_tokens_total", "Prompt tokens the registry verified as a prefix of stored KV"
        )
        self.pulled_tokens = m.counter(
            "kvbridge_gateway_pulled_tokens_total", "Prompt tokens whose KV P pulled from D instead of recomputing"
        )
        self.prompt_tokens = m.counter(
            "kvbridge_gateway_prompt_tokens_total", "Prompt tokens of turns the gateway tokenized"
        )
        self.tokenize = m.counter(
            "kvbridge_gateway_tokenize_total",
            "Turns tokenized, by where the ids came from: local (the gateway's own tokenizer), "
            "engine (P's /tokenize), request (token ids the client sent)",
            ["path"],
        )
        self.tokenize_reused_tokens = m.gauge(
            "kvbridge_gateway_tokenize_reused_tokens",
            "Prompt tokens taken from a conversation's previous "
            "encoding instead of encoded again (local tokenization; grows like a counter)",
        )
        self.lookups = m.counter(
            "kvbridge_gateway_lookups_total",
            "Keyed and content lookups, by who answered: mirror (the gateway's copy of the "
            "registry's entries) or registry (a round trip)",
            ["source"],
        )
        self.mirror_entries = m.gauge(
            "kvbridge_gateway_entry_mirror_entries", "Entries in the gateway's copy of the registry's entries"
        )
        self.mirror_in_sync = m.gauge(
            "kvbridge_gateway_entry_mirror_in_sync", "1 while the copy of the registry's entries may answer lookups"
        )
        self.mirror_lag = m.gauge(
            "kvbridge_gateway_entry_mirror_lag_seconds",
            "Seconds since the entry copy last heard from the registry's watch (-1: never)",
        )
        self.registration_waits = m.histogram(
            "kvbridge_gateway_registration_wait_seconds",
            "Time a lookup waited for the conversation's previous turn to be registered (freshness.py)",
            ["registered"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.secret_mismatch = m.counter(
            "kvbridge_gateway_secret_mismatch_total",
            "Turns refused reuse: the decode engine announced another deployment secret",
            ["engine"],
        )
        self.reuse_retries = m.counter(
            "kvbridge_gateway_reuse_retries_total",
            "Prefills retried without D params after a failure on the reuse path",
        )
        self.registrations = m.counter(
            "kvbridge_gateway_compat_registrations_total",
            "Entries registered by the gateway (compatibility mode), by outcome",
            ["outcome"],
        )
        self.placement = m.counter(
            "kvbridge_gateway_placement_total",
            "Turns by the placement's choice (recompute, pull_to_p, prefill_on_holder) and its reason (placement on)",
            ["choice", "reason"],
        )
        self.moved_tokens = m.counter(
            "kvbridge_gateway_kv_moved_tokens_total",
            "Tokens of KV moved between engines (placement on): history_to_p (P pulled from the holder D), "
            "prompt_to_d (D pulls from P: the prompt less what D's prefix cache holds, estimated)",
            ["path"],
        )
        self.prefill_s_per_token = m.gauge(
            "kvbridge_gateway_prefill_seconds_per_token",
            "Each prefill engine's measured prefill seconds per token (the placement's figure; default until timed)",
            ["engine"],
        )
        self.pull_bytes_per_s = m.gauge(
            "kvbridge_gateway_pull_bytes_per_second",
            "Measured pull bandwidth over all links (the placement's figure; 0 until a pull was timed)",
        )
        self.inflight = m.gauge("kvbridge_gateway_inflight_requests", "Requests being served")
        self.latency = m.histogram(
            "kvbridge_gateway_request_seconds",
            "Request latency until the response starts",
            ["route"],
            buckets=_LATENCY_BUCKETS,
        )
        # TTFT as the gateway sees it: turn start until D's first response bytes (streaming) or its whole
        # response (non-streaming, where the client gets nothing earlier).
        self.ttft = m.histogram(
            "kvbridge_gateway_ttft_seconds",
            "Time to first token through the gateway, by reuse",
            ["reuse"],
            buckets=_LATENCY_BUCKETS,
        )
        # What routing adds before decode starts, engine time excluded: tokenize/hash, registry lookup,
        # engine choice, request rewriting (turn start until the decode request is sent, minus the prefill call).
        self.router_overhead = m.histogram(
            "kvbridge_gateway_router_overhead_seconds",
            "Gateway time per turn outside the prefill and decode calls",
            buckets=_OVERHEAD_BUCKETS,
        )
        self.engine_healthy = m.gauge(
            "kvbridge_gateway_engine_healthy",
            "1 if the engine passed its last check (engine: engine_label, never a URL)",
            ["role", "engine"],
        )

    def count_verdict(self, label: str) -> None:
        """``label``: hit | miss | declined:<reason>."""
        verdict, _, reason = label.partition(":")
        self.reuse.labels(verdict, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
