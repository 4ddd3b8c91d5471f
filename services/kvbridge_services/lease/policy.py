"""Lease policy: every knob of the lease manager, typed and validated at start.

Read from ``KVBRIDGE_LEASE_*`` environment variables by the composition root
only; everything else receives a ``LeasePolicy`` object.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class LeasePolicy(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_LEASE_", extra="ignore")

    port: int = Field(default=50052, ge=0, le=65535, description="gRPC LeaseService port; 0: any free port.")
    # Prometheus /metrics HTTP port; 0: off.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Address other replicas and clients are redirected to; empty: host:port of this server.
    advertise_address: str = ""

    # TTLs (seconds). A grant without a TTL gets the default; others must lie in [min, max].
    default_ttl_s: float = Field(default=60.0, gt=0)
    min_ttl_s: float = Field(default=0.1, gt=0, description="Shortest TTL a grant may ask for.")
    max_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600, description="Longest TTL a grant may ask for.")
    # No renewal keeps one lease alive longer than this after its grant.
    max_lifetime_s: float = Field(default=24 * 3600.0, gt=0, le=365 * 24 * 3600)

    # Retained-token budgets (0: unlimited); hitting one revokes the oldest-idle lease first (reason BUDGET).
    tenant_budget_tokens: int = Field(default=0, ge=0)
    engine_budget_tokens: int = Field(
        default=0,
        ge=0,
        description=(
            "Retained tokens one engine's leases may hold (0: unlimited); past it its oldest-idle lease is revoked "
            "(BUDGET)."
        ),
    )

    # Caps on in-memory state and on request sizes.
    max_leases: int = Field(
        default=1_000_000,
        ge=1,
        le=50_000_000,
        description="Most live leases; a grant past it is refused (RESOURCE_EXHAUSTED).",
    )
    max_ids_per_keepalive: int = Field(
        default=10_000, ge=1, le=1_000_000, description="Most lease ids in one KeepAlive message."
    )
    max_request_ids: int = Field(
        default=100_000,
        ge=0,
        le=10_000_000,
        description=(
            "Grant request ids remembered for idempotent replays (oldest forgotten first; persisted with the lease)."
        ),
    )
    max_ended_remembered: int = Field(
        default=100_000,
        ge=0,
        le=10_000_000,
        description="Ended leases whose end reason is remembered (for GetLease and watchers).",
    )
    max_page_size: int = Field(
        default=1000, ge=1, le=100_000, description="Largest page a ListLeases call may ask for."
    )
    watch_queue_size: int = Field(
        default=100_000,
        ge=16,
        le=10_000_000,
        description=(
            "Events queued for one WatchLeases subscriber; a subscriber that falls further behind is cut off (it re-"
            "lists)."
        ),
    )
    max_watchers: int = Field(default=10_000, ge=1, le=1_000_000, description="Most WatchLeases subscribers at once.")
    keepalive_idle_s: float = Field(
        default=120.0,
        ge=0.1,
        le=24 * 3600,
        description=(
            "A KeepAlive stream that sends no message for this long is closed (UNAVAILABLE / STREAM_IDLE): an idle "
            "stream must not hold a concurrency slot. kvbridge's clients renew far more often, or reopen."
        ),
    )

    # Expiry: how often the deadline heap is checked.
    expiry_tick_s: float = Field(default=0.05, gt=0, le=1.0)
    # Renewals are acknowledged from memory; deadlines are written back this often (0: never), in multi-op
    # txns, for leases whose deadline runs more than checkpoint_max_lag_s ahead of the stored one. The stored
    # deadline is then never more than lag + interval behind the acknowledged one. (Takeover does not rely
    # on it for safety: it extends every lease to at least now + ttl.)
    checkpoint_interval_s: float = Field(default=1.0, ge=0, le=60)
    checkpoint_max_lag_s: float = Field(
        default=10.0,
        ge=0,
        le=3600,
        description=(
            "Only leases whose acknowledged deadline runs more than this ahead of the stored one are checkpointed."
        ),
    )
    # Store writes per checkpoint round, so checkpoints never crowd out grants, ends and the leader key.
    checkpoint_max_puts: int = Field(default=2000, ge=1, le=1_000_000)
    # Ops per store transaction (etcd's default --max-txn-ops is 128).
    store_batch_ops: int = Field(default=128, ge=2, le=10_000)
    store_timeout_s: float = Field(
        default=5.0, gt=0, le=60, description="Deadline of each lease write to the store, all attempts included."
    )
    # Each try of a lease write gets at most this long, then it is sent again (the same effect twice), within
    # store_timeout_s: an etcd leader kill loses the proposals in flight to it (bench/etcd_failover.py).
    store_attempt_timeout_s: float = Field(default=0.5, gt=0, le=60)

    # Log table size, renewals and store traffic this often (0: never).
    stats_log_interval_s: float = Field(default=60.0, ge=0, le=3600)

    # Leader election: the leader key lives on a store lease of this TTL, refreshed this often. A leader that
    # cannot refresh for the TTL steps down, so the TTL must outlast an etcd leader election (default raft
    # timings: 1-3 s, bench/etcd_failover.py); a crashed lease leader is replaced after about this long.
    leader_ttl_s: int = Field(default=5, ge=1, le=60)
    leader_refresh_s: float = Field(
        default=0.5,
        gt=0,
        le=30,
        description="How often the leader refreshes its leader key (at most half the leader TTL).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LeasePolicy:
        if not self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s:
            raise ValueError("need min_ttl_s <= default_ttl_s <= max_ttl_s")
        if self.max_ttl_s > self.max_lifetime_s:
            raise ValueError("max_ttl_s must not exceed max_lifetime_s")
        if self.leader_refresh_s * 2 > self.leader_ttl_s:
            raise ValueError("leader_refresh_s must be at most half of leader_ttl_s")
        return self
