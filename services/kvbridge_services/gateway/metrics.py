"""Prometheus metrics of one gateway instance (in the service's own registry, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvbridge_gateway_requests_total",
            "Client requests by route and status class",
            ["route", "status"],
            registry=r,
        )
        self.reuse = Counter(
            "kvbridge_gateway_reuse_total",
            "Turns by reuse verdict (hit, miss, declined) and the reason of a decline",
            ["verdict", "reason"],
            registry=r,
        )
        self.verified_tokens = Counter(
            "kvbridge_gateway_verified_tokens_total",
            "Prompt tokens the registry verified as a prefix of stored KV",
            registry=r,
        )
        self.pulled_tokens = Counter(
            "kvbridge_gateway_pulled_tokens_total",
            "Prompt tokens whose KV P pulled from D instead of recomputing",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvbridge_gateway_prompt_tokens_total", "Prompt tokens of turns the gateway tokenized", registry=r
        )
        self.tokenize = Counter(
            "kvbridge_gateway_tokenize_total",
            "Turns tokenized, by where the ids came from: local (the gateway's own tokenizer), "
            "engine (P's /tokenize), request (token ids the client sent)",
            ["path"],
            registry=r,
        )
        self.tokenize_reused_tokens = Gauge(
            "kvbridge_gateway_tokenize_reused_tokens",
            "Prompt tokens taken from a conversation's previous "
            "encoding instead of encoded again (local tokenization; grows like a counter)",
            registry=r,
        )
        self.lookups = Counter(
            "kvbridge_gateway_lookups_total",
            "Keyed and content lookups, by who answered: mirror (the gateway's copy of the "
            "registry's entries) or registry (a round trip)",
            ["source"],
            registry=r,
        )
        self.mirror_entries = Gauge(
            "kvbridge_gateway_entry_mirror_entries",
            "Entries in the gateway's copy of the registry's entries",
            registry=r,
        )
        self.mirror_in_sync = Gauge(
            "kvbridge_gateway_entry_mirror_in_sync",
            "1 while the copy of the registry's entries may answer lookups",
            registry=r,
        )
        self.mirror_lag = Gauge(
            "kvbridge_gateway_entry_mirror_lag_seconds",
            "Seconds since the entry copy last heard from the registry's watch (-1: never)",
            registry=r,
        )
        self.registration_waits = Histogram(
            "kvbridge_gateway_registration_wait_seconds",
            "Time a lookup waited for the conversation's previous turn to be registered (freshness.py)",
            ["registered"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.secret_mismatch = Counter(
            "kvbridge_gateway_secret_mismatch_total",
            "Turns refused reuse: the decode engine announced another deployment secret",
            ["engine"],
            registry=r,
        )
        self.reuse_retries = Counter(
            "kvbridge_gateway_reuse_retries_total",
            "Prefills retried without D params after a failure on the reuse path",
            registry=r,
        )
        self.registrations = Counter(
            "kvbridge_gateway_compat_registrations_total",
            "Entries registered by the gateway (compatibility mode), by outcome",
            ["outcome"],
            registry=r,
        )
        self.placement = Counter(
            "kvbridge_gateway_placement_total",
            "Turns by the placement's choice (recompute, pull_to_p, prefill_on_holder) and its reason (placement on)",
            ["choice", "reason"],
            registry=r,
        )
        self.moved_tokens = Counter(
            "kvbridge_gateway_kv_moved_tokens_total",
            "Tokens of KV moved between engines (placement on): history_to_p (P pulled from the holder D), "
            "prompt_to_d (D pulls from P: the prompt less what D's prefix cache holds, estimated)",
            ["path"],
            registry=r,
        )
        self.prefill_s_per_token = Gauge(
            "kvbridge_gateway_prefill_seconds_per_token",
            "Each prefill engine's measured prefill seconds per token (the placement's figure; default until timed)",
            ["engine"],
            registry=r,
        )
        self.pull_bytes_per_s = Gauge(
            "kvbridge_gateway_pull_bytes_per_second",
            "Measured pull bandwidth over all links (the placement's figure; 0 until a pull was timed)",
            registry=r,
        )
        self.inflight = Gauge("kvbridge_gateway_inflight_requests", "Requests being served", registry=r)
        self.latency = Histogram(
            "kvbridge_gateway_request_seconds",
            "Request latency until the response starts",
            ["route"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        # TTFT as the gateway sees it: turn start until D's first response bytes (streaming) or its whole
        # response (non-streaming, where the client gets nothing earlier).
        self.ttft = Histogram(
            "kvbridge_gateway_ttft_seconds",
            "Time to first token through the gateway, by reuse",
            ["reuse"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        # What routing adds before decode starts, engine time excluded: tokenize/hash, registry lookup,
        # engine choice, request rewriting (turn start until the decode request is sent, minus the prefill call).
        self.router_overhead = Histogram(
            "kvbridge_gateway_router_overhead_seconds",
            "Gateway time per turn outside the prefill and decode calls",
            registry=r,
            buckets=_OVERHEAD_BUCKETS,
        )
        self.engine_healthy = Gauge(
            "kvbridge_gateway_engine_healthy", "1 if the engine passed its last check", ["role", "url"], registry=r
        )

    def count_verdict(self, label: str) -> None:
        """``label``: hit | miss | declined:<reason>."""
        verdict, _, reason = label.partition(":")
        self.reuse.labels(verdict, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
