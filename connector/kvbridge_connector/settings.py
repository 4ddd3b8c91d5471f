"""Connector settings, read from ``kv_connector_extra_config`` (then env) once at start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge import secret as kvsecret
from kvbridge import telemetry

ENV_HASH_SECRET = kvsecret.ENV  # hex, the gateway's setting too (kvbridge.secret)
ENV_API_KEY = "KVBRIDGE_API_KEY"
# Same variable as the services' TelemetrySettings.hash_key_hex: one key, so a conversation hashes alike everywhere.
ENV_TELEMETRY_HASH_KEY = "KVBRIDGE_TELEMETRY_HASH_KEY_HEX"
DEFAULT_SERVICE_NAME = "kvbridge-connector"


def _hash_key(text: str) -> bytes | None:
    if not text:
        return None
    key = bytes.fromhex(text)
    if not 16 <= len(key) <= 64:
        raise ValueError("kvbridge_telemetry_hash_key_hex must decode to 16..64 bytes")
    return key


def _otlp_endpoint(extra: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """Where connector spans go: the extra-config key, else the standard OTEL_* variables; None = tracing off."""
    explicit = str(extra.get("kvbridge_otlp_endpoint", "") or "")
    if explicit:
        return explicit
    if not telemetry.otlp_traces_configured(env):
        return None
    # "" = the exporter's default (it also reads OTEL_EXPORTER_OTLP_* headers, TLS and timeout itself).
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def _float(extra: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = float(extra.get(name, default))
    if not low <= value <= high:
        raise ValueError(f"kv_connector_extra_config.{name}={value} is outside [{low}, {high}]")
    return value


def _peer_tls(extra: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, bytes | None]:
    """PEM files from ``kvbridge_tls_{ca,cert,key}_file`` or the services' ``KVBRIDGE_PEER_*_FILE`` variables."""
    paths = {
        part: str(extra.get(f"kvbridge_tls_{part}_file") or env.get(f"KVBRIDGE_PEER_{part.upper()}_FILE") or "")
        for part in ("ca", "cert", "key")
    }
    if bool(paths["cert"]) != bool(paths["key"]):
        raise ValueError("kvbridge_tls_cert_file and kvbridge_tls_key_file must be given together")
    if paths["cert"] and not paths["ca"]:
        raise ValueError("kvbridge_tls_cert_file/kvbridge_tls_key_file (mutual TLS) need kvbridge_tls_ca_file")
    out: dict[str, bytes | None] = {}
    for part, path in paths.items():
        try:
            out[f"tls_{part}"] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise ValueError(f"kvbridge_tls_{part}_file: {exc}") from exc
    return out


def _choice(extra: Mapping[str, Any], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = str(extra.get(name, default))
    if value not in allowed:
        raise ValueError(f"kv_connector_extra_config.{name}={value!r} is not one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    # gRPC target of the registry; empty disables the control plane (stock TTL behaviour).
    registry_target: str = ""
    # gRPC target of the lease manager; defaults to registry_target.
    lease_target: str = ""
    api_key: str | None = None
    hash_secret: bytes | None = None
    # Served model name for entry keys and hash chains ("" = vLLM's served model name).
    model: str = ""
    # HTTP URL this engine serves on (registered so the gateway can reach it).
    http_url: str = ""
    # Bound on how long retained blocks live without a confirmed live lease.
    fallback_ttl_s: float = 120.0
    entry_lease_ttl_s: float = 60.0
    node_lease_ttl_s: float = 15.0
    # Decode: the time a prefill has from the gateway's lookup of an entry to the start of its READ
    # (published in the engine record as offer_window; P declines a READ that would start later).
    offer_window_s: float = 5.0
    # Decode: the bound on how far the registry's index and the gateways' entry mirrors may lag the store
    # (KVBRIDGE_REGISTRY_INDEX_MAX_LAG_S); an index further behind answers no hits.
    index_max_lag_s: float = 3.0
    # How long D keeps a withdrawn entry's blocks after the withdrawal is confirmed (lease ended) before
    # freeing them: a prefill offered them just before may still start its READ. Memory pressure
    # included: at least offer_window_s + index_max_lag_s + 1 s (the 1 s covers the READ itself).
    free_grace_s: float = 10.0
    # Decode: the least free-block headroom (a fraction of the cache) D keeps: below it, retained entries are
    # withdrawn (oldest idle first) and finished requests are not retained.
    free_kv_watermark: float = 0.2
    # Decode: how long D remembers the peak of live requests' KV demand; the headroom holds what live demand may
    # grow to (that peak) beyond what it uses now (ADR 0026). 0 (and anything shorter): one horizon,
    # free_grace_s + rpc_deadline_s, the time a withdrawal decided now takes to free its blocks.
    demand_window_s: float = 0.0
    rpc_deadline_s: float = 2.0
    queue_size: int = 1024
    max_retained_entries: int = 4096
    # Run NIXL without its busy progress thread (~1 core per idle worker on CPU).
    nixl_progress_thread: bool = True
    # TLS towards the registry and lease manager (PEM bytes); CA alone: TLS, + cert and key: mutual TLS.
    tls_ca: bytes | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    # How D keeps retained blocks: "refcount" (its own reference on the blocks; the engine goes idle
    # between turns) or "delayed_free" (vLLM's delayed free: the engine keeps stepping while it holds).
    hold_blocks: str = "refcount"
    # Prefill: decline (recompute) a pull offer that carries no prompt-prefix digest. Off only for
    # routers other than the gateway that cannot send one (docs/connector.md).
    require_prefix_digest: bool = True
    # Prefill: decline (recompute) a pull offer that carries no read deadline (kvbridge_offer_ttl_ms).
    require_offer_deadline: bool = True
    # Prefill: pull only offers a gateway signed with the deployment secret (kvbridge.secret.sign_pull_offer);
    # anything else, from any HTTP caller, is declined and recomputed.
    require_signed_offer: bool = True
    # OTLP/gRPC endpoint for connector spans; None: tracing off ("" = the exporter's default endpoint).
    otlp_endpoint: str | None = None
    service_name: str = DEFAULT_SERVICE_NAME
    # Key hashing tenant / conversation span attributes; None: a random per-process key.
    telemetry_hash_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        least_grace = self.offer_window_s + self.index_max_lag_s + 1.0
        if self.free_grace_s < least_grace:
            raise ValueError(
                f"kv_connector_extra_config.kvbridge_free_grace_s={self.free_grace_s} must be at least "
                f"kvbridge_offer_window_s + kvbridge_index_max_lag_s + 1 = {least_grace}: a prefill offered "
                "an entry just before it was withdrawn may start its READ that late"
            )
        least_fallback = self.node_lease_ttl_s + self.free_grace_s
        if self.fallback_ttl_s < least_fallback:
            raise ValueError(
                f"kv_connector_extra_config.kvbridge_fallback_ttl_s={self.fallback_ttl_s} must be at least "
                f"kvbridge_node_lease_ttl_s + kvbridge_free_grace_s = {least_fallback}: blocks held without a "
                "confirmed lease may be freed only once the engine's node lease (and so every offer) has ended"
            )

    @property
    def tracing_enabled(self) -> bool:
        return self.otlp_endpoint is not None

    def secret_capabilities(self) -> list[str]:
        """The engine capability with the deployment secret's canary (the gateway checks it shares the secret)."""
        return [kvsecret.canary_capability(self.hash_secret)] if self.hash_secret else []

    @property
    def control_plane_enabled(self) -> bool:
        return bool(self.registry_target)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ConnectorSettings:
        env = os.environ if env is None else env
        secret_text = extra.get("kvbridge_hash_secret") or env.get(ENV_HASH_SECRET) or ""
        registry = str(extra.get("kvbridge_registry", ""))
        if registry and not secret_text:
            # Without it the engine's chains match no gateway's and it cannot verify the gateway's fields.
            raise ValueError(
                f"kvbridge_registry is set: the deployment secret (kvbridge_hash_secret or "
                f"{ENV_HASH_SECRET}, hex, the gateway's) is required too"
            )
        return cls(
            registry_target=registry,
            lease_target=str(extra.get("kvbridge_lease", "") or registry),
            api_key=str(extra.get("kvbridge_api_key") or env.get(ENV_API_KEY) or "") or None,
            hash_secret=kvsecret.parse(str(secret_text), setting=f"kvbridge_hash_secret / {ENV_HASH_SECRET}")
            if secret_text
            else None,
            model=str(extra.get("kvbridge_model", "")),
            http_url=str(extra.get("kvbridge_http_url", "")),
            fallback_ttl_s=_float(extra, "kvbridge_fallback_ttl_s", 120.0, 1.0, 3600.0),
            entry_lease_ttl_s=_float(extra, "kvbridge_entry_lease_ttl_s", 60.0, 1.0, 3600.0),
            node_lease_ttl_s=_float(extra, "kvbridge_node_lease_ttl_s", 15.0, 1.0, 600.0),
            free_kv_watermark=_float(extra, "kvbridge_free_kv_watermark", 0.2, 0.0, 0.95),
            demand_window_s=_float(extra, "kvbridge_demand_window_s", 0.0, 0.0, 3600.0),
            offer_window_s=_float(extra, "kvbridge_offer_window_s", 5.0, 0.1, 300.0),
            index_max_lag_s=_float(extra, "kvbridge_index_max_lag_s", 3.0, 0.05, 300.0),
            free_grace_s=_float(extra, "kvbridge_free_grace_s", 10.0, 1.0, 3600.0),
            rpc_deadline_s=_float(extra, "kvbridge_rpc_deadline_s", 2.0, 0.05, 60.0),
            queue_size=int(_float(extra, "kvbridge_queue_size", 1024, 16, 65536)),
            max_retained_entries=int(_float(extra, "kvbridge_max_retained_entries", 4096, 1, 1_000_000)),
            nixl_progress_thread=bool(extra.get("kvbridge_nixl_progress_thread", True)),
            **_peer_tls(extra, env),
            hold_blocks=_choice(extra, "kvbridge_hold_blocks", "refcount", ("refcount", "delayed_free")),
            require_prefix_digest=bool(extra.get("kvbridge_require_prefix_digest", True)),
            require_offer_deadline=bool(extra.get("kvbridge_require_offer_deadline", True)),
            require_signed_offer=bool(extra.get("kvbridge_require_signed_offer", True)),
            otlp_endpoint=_otlp_endpoint(extra, env),
            service_name=env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
            telemetry_hash_key=_hash_key(
                str(extra.get("kvbridge_telemetry_hash_key_hex") or env.get(ENV_TELEMETRY_HASH_KEY) or "")
            ),
        )
