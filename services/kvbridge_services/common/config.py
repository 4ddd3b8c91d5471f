"""Settings shared by every service, typed and validated at start.

Read only by composition roots (``python -m kvbridge_services.<name>``) from
``KVBRIDGE_*`` environment variables; everything below them receives typed
objects.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .limits import RpcLimits


def check_client_tls_files(settings: object, names: tuple[str, str, str], *, label: str = "") -> None:
    """The (CA, client certificate, client key) fields of a TLS client: certificate and key together, a CA
    for mutual TLS, and every given file readable. ValueError naming the fields otherwise."""
    ca_name, cert_name, key_name = names
    ca, cert, key = (getattr(settings, name) for name in names)
    if (cert is None) != (key is None):
        raise ValueError(f"{label}{cert_name} and {key_name} must be given together")
    if cert is not None and ca is None:
        raise ValueError(f"{label}{cert_name}/{key_name} (mutual TLS) need {ca_name}")
    for name in names:
        path: Path | None = getattr(settings, name)
        if path is not None and not (path.is_file() and os.access(path, os.R_OK)):
            raise ValueError(f"{label}{name} {str(path)!r} is not a readable file")


class StoreSettings(BaseSettings):
    """Where state lives: etcd when endpoints are given, else the embedded store."""

    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_", extra="ignore")

    # Comma-separated host:port list; empty selects the embedded in-process store.
    etcd_endpoints: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Versioned key prefix of every kvbridge key in etcd.
    etcd_prefix: str = "/kvbridge/v1"
    etcd_timeout_s: float = Field(default=5.0, gt=0, le=60, description="Deadline of each etcd call.")
    etcd_start_timeout_s: float = Field(
        default=30.0,
        ge=0,
        le=24 * 3600,
        description=(
            "At start, how long a service waits for etcd to answer before it exits (one line, exit code 4); "
            "0: wait for ever."
        ),
    )
    # TLS towards etcd (PEM files). CA alone: verify etcd's server certificate. CA + cert + key: mutual TLS,
    # for etcd started with --client-cert-auth. Unset: plaintext.
    etcd_ca_file: Path | None = None
    etcd_cert_file: Path | None = Field(
        default=None,
        description=(
            "Client certificate (PEM) for etcd's --client-cert-auth; with KVBRIDGE_ETCD_KEY_FILE and "
            "KVBRIDGE_ETCD_CA_FILE."
        ),
    )
    etcd_key_file: Path | None = Field(default=None, description="Client key (PEM) of KVBRIDGE_ETCD_CERT_FILE.")

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("etcd_endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        for ep in value:
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"etcd endpoint {ep!r} is not host:port")
        return value

    @field_validator("etcd_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not value.startswith("/") or value.endswith("/") or len(value) > 128:
            raise ValueError("etcd_prefix must start with '/', not end with '/', and be at most 128 chars")
        return value

    @model_validator(mode="after")
    def _check_etcd_tls(self) -> StoreSettings:
        check_client_tls_files(self, ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"))
        return self

    @property
    def embedded(self) -> bool:
        return not self.etcd_endpoints

    def etcd_tls(self) -> EtcdTls | None:
        """The PEM material for the etcd channel (read now), or None for plaintext."""
        if self.etcd_ca_file is None:
            return None
        return EtcdTls(
            ca_pem=self.etcd_ca_file.read_bytes(),
            cert_pem=self.etcd_cert_file.read_bytes() if self.etcd_cert_file else None,
            key_pem=self.etcd_key_file.read_bytes() if self.etcd_key_file else None,
        )


@dataclass(frozen=True)
class EtcdTls:
    """TLS material for etcd client connections (PEM bytes)."""

    ca_pem: bytes
    cert_pem: bytes | None = None
    key_pem: bytes | None = None

    def __repr__(self) -> str:  # never print a private key
        return f"EtcdTls(ca={len(self.ca_pem)}B, client_cert={'yes' if self.cert_pem else 'no'})"


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name or "" / "0.0.0.0"-like wildcard: reachable from elsewhere


def check_bind(host: str, *, secured: bool, insecure: bool, what: str = "server") -> None:
    """Secure by default: without API keys a service listens on loopback only, unless KVBRIDGE_INSECURE=1
    says it is meant to run open (a mesh that authenticates for it). ValueError naming the settings otherwise."""
    if secured or insecure or is_loopback(host):
        return
    raise ValueError(
        f"{what}: refusing to listen on {host!r} without API keys (every caller would hold every role); set "
        "KVBRIDGE_API_KEYS_FILE, bind a loopback address (KVBRIDGE_HOST=127.0.0.1), or set KVBRIDGE_INSECURE=1 "
        "to run open on purpose"
    )


class ServerSettings(BaseSettings):
    """gRPC server knobs common to all services."""

    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_", extra="ignore")

    host: str = Field(
        default="127.0.0.1",
        description=(
            "Bind address of the service's gRPC server (loopback unless API keys are set or KVBRIDGE_INSECURE=1)."
        ),
    )
    # JSON file mapping API keys to principals; unset = insecure development mode (loopback only, see insecure).
    api_keys_file: Path | None = None
    # KVBRIDGE_INSECURE=1: allow a non-loopback bind without API keys (development mode reachable from elsewhere).
    insecure: bool = False
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024, ge=64 * 1024, le=64 * 1024 * 1024, description="Largest gRPC message received or sent."
    )
    max_concurrent_rpcs: int = Field(
        default=1024,
        ge=4,
        le=100_000,
        description=(
            "RPCs and streams served at once; more are refused with RESOURCE_EXHAUSTED / OVERLOADED. Tenants and "
            "health/reflection callers get bounded parts of it (below); engine, gateway and operator keys the rest."
        ),
    )
    # Per-principal limits (common/limits.py, ADR 0025): a tenant key never takes the slots engines need.
    tenant_rpc_share: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description=(
            "Share of KVBRIDGE_MAX_CONCURRENT_RPCS all tenant keys together may hold (idle streams included); the "
            "rest, less KVBRIDGE_MAX_PUBLIC_RPCS, is kept for engine, gateway and operator keys."
        ),
    )
    max_rpcs_per_tenant: int = Field(
        default=128,
        ge=1,
        le=100_000,
        description=(
            "Concurrent RPCs and streams of one tenant (all its keys) on one server; one more is refused with "
            "RESOURCE_EXHAUSTED / OVERLOADED, metadata limit=per_tenant. Capped at the tenant share."
        ),
    )
    max_public_rpcs: int = Field(
        default=32,
        ge=1,
        le=10_000,
        description=(
            "Concurrent health and reflection calls (no credentials needed); at most half of what the tenant share "
            "leaves."
        ),
    )
    # Connections (grpc server options; 0 turns one off).
    max_connection_idle_s: float = Field(
        default=900.0,
        ge=0,
        le=7 * 24 * 3600,
        description="A client connection with no RPC for this long is closed (GOAWAY); clients reconnect. 0: never.",
    )
    max_connection_age_s: float = Field(
        default=7200.0,
        ge=0,
        le=30 * 24 * 3600,
        description=(
            "A client connection older than this (gRPC adds +-10% jitter) is asked to reconnect (GOAWAY); its "
            "streams get KVBRIDGE_MAX_CONNECTION_AGE_GRACE_S more. 0: never."
        ),
    )
    max_connection_age_grace_s: float = Field(
        default=60.0,
        ge=0,
        le=24 * 3600,
        description="How long RPCs on a connection past its age may go on before they are cancelled.",
    )
    keepalive_time_s: float = Field(
        default=60.0,
        ge=1,
        le=24 * 3600,
        description="The server pings a connection idle for this long, to find dead clients holding streams.",
    )
    keepalive_timeout_s: float = Field(
        default=20.0, ge=1, le=3600, description="A ping not answered within this closes the connection."
    )
    min_client_ping_interval_s: float = Field(
        default=5.0,
        ge=0,
        le=3600,
        description=(
            "Client keepalive pings more frequent than this are refused (GOAWAY too_many_pings); kvbridge's own "
            "clients ping every 10 s or more."
        ),
    )
    shutdown_grace_s: float = Field(
        default=5.0, ge=0, le=120, description="On SIGTERM, how long RPCs in flight may finish before the server stops."
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    # TLS (PEM files). Cert + key: serve TLS. Client CA too: mutual TLS, clients without a cert it signed are
    # refused during the handshake. Unset: plaintext (loopback or inside a mesh).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = Field(default=None, description="Private key (PEM) of KVBRIDGE_TLS_CERT_FILE.")
    tls_client_ca_file: Path | None = Field(
        default=None, description="CA (PEM) that must have signed clients' certificates: mutual TLS."
    )

    @model_validator(mode="after")
    def _check_tls(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        self.rpc_limits()  # ValueError naming the settings when they leave services no share
        return self

    def rpc_limits(self) -> RpcLimits:
        """The per-class limits of common/limits.py: the tenant share (at least 1), one tenant's cap clamped to
        it, and the public cap (at most half of the rest); services keep the rest (at least one slot, or
        ValueError)."""
        total = self.max_concurrent_rpcs
        tenant_pool = max(1, int(total * self.tenant_rpc_share))
        public = min(self.max_public_rpcs, max(1, (total - tenant_pool) // 2))
        if tenant_pool + public >= total:
            raise ValueError(
                f"max_concurrent_rpcs ({total}) leaves engine/gateway/operator keys no share: the tenant share "
                f"({tenant_pool}, tenant_rpc_share={self.tenant_rpc_share}) plus max_public_rpcs ({public}) "
                "must stay below it"
            )
        return RpcLimits(
            total=total, tenant_pool=tenant_pool, per_tenant=min(self.max_rpcs_per_tenant, tenant_pool), public=public
        )

    def grpc_options(self) -> list[tuple[str, int]]:
        """Connection age, idle and keepalive options of the gRPC server (a value of 0 is left out: off)."""

        def ms(seconds: float) -> int:
            return int(seconds * 1000)

        opts = [
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            # grpc's name for the shortest interval between client pings it accepts (GRPC_ARG_HTTP2_MIN_RECV_...).
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
        ]
        if self.max_connection_idle_s:
            opts.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)))
        if self.max_connection_age_s:
            opts.append(("grpc.max_connection_age_ms", ms(self.max_connection_age_s)))
            opts.append(("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)))
        return opts


class PeerTlsSettings(BaseSettings):
    """TLS for a service's own gRPC clients towards other kvbridge services (gateway → registry and lease
    manager, registry → lease manager). CA alone: verify the peer's certificate. CA + cert + key: mutual
    TLS, for peers serving with ``KVBRIDGE_TLS_CLIENT_CA_FILE``. Unset: plaintext (loopback or a mesh)."""

    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_PEER_", extra="ignore")

    ca_file: Path | None = Field(
        default=None, description="CA (PEM) verifying the peer service's certificate; unset: plaintext."
    )
    cert_file: Path | None = Field(
        default=None,
        description="Our client certificate (PEM) for a peer serving mutual TLS; with KVBRIDGE_PEER_KEY_FILE.",
    )
    key_file: Path | None = Field(default=None, description="Private key (PEM) of KVBRIDGE_PEER_CERT_FILE.")
    # The name the peer's certificate must carry, when it differs from the target's host name.
    server_name: str = ""

    @model_validator(mode="after")
    def _check(self) -> PeerTlsSettings:
        check_client_tls_files(self, ("ca_file", "cert_file", "key_file"), label="peer ")
        return self

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None
