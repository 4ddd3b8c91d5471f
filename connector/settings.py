"""Connector settings, read from ``kv_connector_extra_config`` (then env) once at start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge import telemetry

ENV_HASH_SECRET = "KVBRIDGE_HASH_SECRET"
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
    paths = {part: str(extra.get(f"kvbridge_tls_{part}_file") or env.get(f"KVBRIDGE_PEER_{part.upper()}_FILE") or "")
             for part in ("ca", "cert", "key")}
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
    # How long D keeps an ended entry's blocks before freeing them: a prefill sent just before the lease
    # ended may still be reading them (memory pressure cuts it short).
    free_grace_s: float = 10.0
    # Evict retained entries (oldest idle first) while free KV is below this fraction.
    free_kv_watermark: float = 0.2
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
    # OTLP/gRPC endpoint for connector spans; None: tracing off ("" = the exporter's default endpoint).
    otlp_endpoint: str | None = None
    service_name: str = DEFAULT_SERVICE_NAME
    # Key hashing tenant / conversation span attributes; None: a random per-process key.
    telemetry_hash_key: bytes | None = field(default=None, repr=False)

    @property
    def tracing_enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def control_plane_enabled(self) -> bool:
        return bool(self.registry_target)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ConnectorSettings:
        env = os.environ if env is None else env
        secret_text = extra.get("kvbridge_hash_secret") or env.get(ENV_HASH_SECRET) or ""
        registry = str(extra.get("kvbridge_registry", ""))
        return cls(
            registry_target=registry,
            lease_target=str(extra.get("kvbridge_lease", "") or registry),
            api_key=str(extra.get("kvbridge_api_key") or env.get(ENV_API_KEY) or "") or None,
            hash_secret=str(secret_text).encode() if secret_text else None,
            model=str(extra.get("kvbridge_model", "")),
            http_url=str(extra.get("kvbridge_http_url", "")),
            fallback_ttl_s=_float(extra, "kvbridge_fallback_ttl_s", 120.0, 1.0, 3600.0),
            entry_lease_ttl_s=_float(extra, "kvbridge_entry_lease_ttl_s", 60.0, 1.0, 3600.0),
            node_lease_ttl_s=_float(extra, "kvbridge_node_lease_ttl_s", 15.0, 1.0, 600.0),
            free_kv_watermark=_float(extra, "kvbridge_free_kv_watermark", 0.2, 0.0, 0.95),
            free_grace_s=_float(extra, "kvbridge_free_grace_s", 10.0, 0.0, 600.0),
            rpc_deadline_s=_float(extra, "kvbridge_rpc_deadline_s", 2.0, 0.05, 60.0),
            queue_size=int(_float(extra, "kvbridge_queue_size", 1024, 16, 65536)),
            max_retained_entries=int(_float(extra, "kvbridge_max_retained_entries", 4096, 1, 1_000_000)),
            nixl_progress_thread=bool(extra.get("kvbridge_nixl_progress_thread", True)),
            **_peer_tls(extra, env),
            hold_blocks=_choice(extra, "kvbridge_hold_blocks", "refcount", ("refcount", "delayed_free")),
            require_prefix_digest=bool(extra.get("kvbridge_require_prefix_digest", True)),
            otlp_endpoint=_otlp_endpoint(extra, env),
            service_name=env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
            telemetry_hash_key=_hash_key(
                str(extra.get("kvbridge_telemetry_hash_key_hex") or env.get(ENV_TELEMETRY_HASH_KEY) or "")),
        )
