"""Registry settings (env prefix ``KVBRIDGE_REGISTRY_``), read only by the composition root."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RegistrySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_REGISTRY_", extra="ignore")

    port: int = Field(default=50051, ge=0, le=65535, description="gRPC RegistryService port; 0: any free port.")
    # Prometheus /metrics HTTP port; 0: off.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Hash record: keep every chain_stride-th block hash plus the last one.
    chain_stride: int = Field(default=4, ge=1, le=1024)
    # ... and every block hash of an entry's last chain_exact_tail_blocks blocks (rounded out to a stride
    # boundary), so a prompt diverging there (the previous turn's output re-rendered, reasoning stripped) is
    # verified exactly to the block; 0: checkpoints only (docs/adr/0018). 16 bytes per tail block in the store.
    chain_exact_tail_blocks: int = Field(default=128, ge=0, le=1 << 20)
    # Content-addressed lookups index every content_index_stride-th block hash (a multiple of
    # chain_stride) plus each entry's final one.
    content_index_stride: int = Field(default=16, ge=1, le=4096)
    max_blocks_per_chain: int = Field(
        default=32768,
        ge=1,
        le=1 << 20,
        description=(
            "Most blocks (hash-chain length) of one entry; a longer registration is refused with INVALID_ARGUMENT."
        ),
    )
    max_kv_groups: int = Field(
        default=16, ge=1, le=256, description="Most KV cache groups (block id lists) of one entry."
    )
    # Per-tenant cap on entries; registering past it evicts the tenant's oldest-idle entry.
    max_entries_per_tenant: int = Field(default=10_000, ge=1, le=10_000_000)
    # Cap of the whole in-memory index (entries + engines); past it new registrations are refused.
    max_index_entries: int = Field(default=1_000_000, ge=1, le=100_000_000)
    max_engines: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="Most registered engines; one more is refused with RESOURCE_EXHAUSTED.",
    )
    # How long a request id is remembered for idempotent replays.
    idempotency_ttl_s: int = Field(default=600, ge=10, le=86_400)
    # Content-addressed lookups verify at most this many candidate entries.
    max_content_candidates: int = Field(default=32, ge=1, le=1024)
    # Freshness bound of the watch-fed index (docs/adr/0015): past this many seconds without hearing from the
    # store (a watch event or a progress notification, asked for every quarter of it) lookups answer
    # INDEX_STALE instead of a hit and the health status is NOT_SERVING; the watch is restarted once it has
    # been silent for 4x this (at least 5 s).
    index_max_lag_s: float = Field(default=2.5, ge=0.2, le=300)
    # How often engines whose node lease ended are deregistered.
    engine_sweep_interval_s: float = Field(default=2.0, gt=0, le=300)
    # LeaseService endpoint (host:port) for revoking superseded/evicted leases; empty: leases are
    # left to expire by TTL (logged), e.g. in tests without a lease manager.
    lease_service_target: str = ""
    # The key the registry presents to the lease manager: KVBRIDGE_API_KEY, the one service key of the stack,
    # unless KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY overrides it.
    lease_service_api_key: str = Field(
        default="",
        validation_alias=AliasChoices(
            "lease_service_api_key", "KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY", "KVBRIDGE_API_KEY"
        ),
    )
    lease_rpc_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Deadline of each call to the lease manager (revoking superseded and evicted entries' leases).",
    )

    # Group commit of registrations (docs/adr/0005): "auto" batches on etcd, not on the embedded store
    # (where a txn costs no round trip or fsync, so batching only adds the window's latency).
    register_batching: Literal["auto", "on", "off"] = "auto"
    # Collect registrations for at most this long after the first one arrives (or until register_batch_max).
    register_batch_window_ms: float = Field(default=2.0, ge=0, le=100)
    register_batch_max: int = Field(default=64, ge=1, le=1024, description="Most registrations in one group commit.")
    # etcd's --max-txn-ops (compares, and ops per branch, of one txn); larger batches are split.
    register_batch_max_txn_ops: int = Field(default=128, ge=8, le=100_000)
    # Bytes of puts per txn: under etcd's --max-request-bytes (default 1.5 MiB).
    register_batch_max_bytes: int = Field(default=1_000_000, ge=4096, le=64 << 20)
    # Rounds committing at the same time (keys never overlap between them). 1 is classic group commit: the
    # next round gathers while one commits; it measured the largest batches and the least CPU on etcd.
    register_batch_max_inflight: int = Field(default=1, ge=1, le=64)

    # Server processes behind the one gRPC port (SO_REUSEPORT), each a full replica with its own watch-fed
    # index: lookups cost ~0.2 ms of grpc's per-call CPU, so one process serves about one core's worth.
    # etcd only (the embedded store lives inside one process); /metrics of process i is on metrics_port + i.
    serve_processes: int = Field(default=1, ge=1, le=64)

    @model_validator(mode="after")
    def _content_stride_on_checkpoints(self) -> RegistrySettings:
        if self.content_index_stride % self.chain_stride:
            raise ValueError("content_index_stride must be a multiple of chain_stride")
        return self
