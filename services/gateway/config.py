"""Gateway settings (env prefix ``KVBRIDGE_GATEWAY_``), read only by the composition root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from kvbridge import secret as kvsecret
from pydantic import AliasChoices, BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class StaticEngine(BaseModel):
    """An engine given by configuration rather than found in the registry.

    With ``engine_id``/``kv_host``/``kv_port`` set (``register_in_registry=True``), the gateway registers it in the
    registry under a node lease it keeps alive, so stock vLLM engines can serve reuse (compatibility mode).
    """

    url: str
    model: str = ""
    engine_id: str = ""
    kv_host: str = ""
    kv_port: int = Field(default=0, ge=0, lt=65536)
    block_size: int = Field(default=0, ge=0, le=1024)
    register_in_registry: bool = False

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"engine url {value!r} must start with http:// or https://")
        return value.rstrip("/")


def _engines(value: object) -> object:
    """Accepts a JSON list (of URLs or objects) or a comma-separated URL list."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):
            value = json.loads(text)
        else:
            return [{"url": u.strip()} for u in text.split(",") if u.strip()]
    if isinstance(value, list):
        return [{"url": v} if isinstance(v, str) else v for v in value]
    return value


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVBRIDGE_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, lt=65536)
    grpc_port: int = Field(default=50053, ge=0, lt=65536)

    # Control plane (gRPC only). Empty address: run without it (no reuse, plain P/D routing).
    registry_address: str = "127.0.0.1:50051"
    lease_address: str = "127.0.0.1:50052"
    # Connections to the registry, used in turn: more than one spreads lookups over a registry replica's
    # server processes (KVBRIDGE_REGISTRY_SERVE_PROCESSES; SO_REUSEPORT spreads connections, not calls).
    registry_connections: int = Field(default=1, ge=1, le=64)
    # API key the gateway presents to registry and lease manager (its gateway role there): KVBRIDGE_API_KEY, the
    # one service key of the stack, unless KVBRIDGE_GATEWAY_CONTROL_API_KEY overrides it.
    control_api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("control_api_key", "KVBRIDGE_GATEWAY_CONTROL_API_KEY", "KVBRIDGE_API_KEY"),
    )
    control_timeout_s: float = Field(default=1.0, gt=0, le=30)

    # Client API keys (JSON, see services/common/auth.py): KVBRIDGE_API_KEYS_FILE, the one keys file of the stack
    # (KVBRIDGE_GATEWAY_API_KEYS_FILE, the older name, still works). Unset = insecure development mode.
    api_keys_file: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("api_keys_file", "KVBRIDGE_API_KEYS_FILE", "KVBRIDGE_GATEWAY_API_KEYS_FILE"),
    )
    # The deployment secret (kvbridge.secret): hex, shared by every gateway replica and every connector. Required
    # with API keys; KVBRIDGE_HASH_SECRET, the connector's name too (KVBRIDGE_GATEWAY_HASH_SECRET_HEX still works).
    hash_secret_hex: str = Field(
        default="",
        validation_alias=AliasChoices("hash_secret_hex", "KVBRIDGE_HASH_SECRET", "KVBRIDGE_GATEWAY_HASH_SECRET_HEX"),
    )

    # Engine pools: static config plus engines registered in the registry.
    # NoDecode: the validator below accepts JSON *or* a comma-separated URL list from the env.
    prefill_engines: Annotated[list[StaticEngine], NoDecode] = Field(default_factory=list)
    decode_engines: Annotated[list[StaticEngine], NoDecode] = Field(default_factory=list)
    engines_from_registry: bool = True
    registry_refresh_s: float = Field(default=5.0, gt=0, le=600)
    health_interval_s: float = Field(default=2.0, gt=0, le=600)
    health_timeout_s: float = Field(default=1.0, gt=0, le=60)
    # Weight of vLLM's KV usage (0..1) against outstanding requests in the load score.
    kv_usage_weight: float = Field(default=4.0, ge=0, le=1000)

    # Reuse policy.
    reuse_enabled: bool = True
    reuse_threshold_tokens: int = Field(default=64, ge=1, le=10_000_000)
    default_block_size: int = Field(default=16, ge=1, le=1024)
    # Compatibility mode: stock vLLM, no connector: the gateway registers entries from D's responses.
    compat_registration: bool = True
    # Stock vLLM frees D's blocks when P reads them: an entry of an engine without the kvbridge connector serves
    # one prefill, taken in the registry (an atomic consume) before P pulls, so it holds across gateway replicas.
    single_use_entries: bool = True
    # The stock decode engines' decoder_kv_blocks_ttl (vLLM kv_connector_extra_config, default 480 s): how long
    # D holds a finished request's blocks. A gateway-registered entry expires this long after its decode request
    # went out; renewals never extend it. Must not exceed the engines' own value.
    compat_decoder_kv_blocks_ttl_s: float = Field(default=480.0, gt=0, le=86_400)
    entry_lease_ttl_s: float = Field(default=300.0, gt=0, le=86_400)
    # Content-addressed lookups for requests without a conversation key.
    content_lookup: bool = False
    # Keyed lookups answered from the gateway's own WatchEntries-fed copy of the registry's entries (ADR 0008):
    # no round trip before the prefill. Only hits are answered from it, only while it is in sync (a message
    # within entry_mirror_stale_after_s); the rest go to the registry. Beyond max_entries, entries stay
    # registry-only. An entry of an 8K-token conversation is ~4 KB (hash checkpoints and block ids), so the default
    # bounds the copy near 200 MB.
    entry_mirror: bool = True
    entry_mirror_max_entries: int = Field(default=50_000, ge=1, le=10_000_000)
    entry_mirror_stale_after_s: float = Field(default=3.0, ge=0.3, le=300)

    # Local tokenization: model name -> directory with that model's HF tokenizer files (tokenizer.json,
    # tokenizer_config.json, chat template), the same the engines load. Listed models are tokenized in the
    # gateway instead of by P's /tokenize (one round trip less per turn); others, and requests the local
    # tokenizer cannot reproduce exactly, still use /tokenize. JSON in the env: {"model": "/path"}.
    tokenizers: dict[str, Path] = Field(default_factory=dict)
    # A conversation's previous prompt encoding is kept so its next turn encodes only the new text (bounded LRU
    # over all models; 0 turns it off).
    tokenizer_prefix_cache_mb: int = Field(default=256, ge=0, le=65_536)
    # A conversation's last hashed token ids and block-hash chain are kept so its next turn hashes only new
    # blocks (chaincache.py; ~5 bytes a token; bounded LRU over all conversations; 0 turns it off).
    chain_cache_mb: int = Field(default=256, ge=0, le=65_536)

    # Limits.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_messages: int = Field(default=2048, ge=1, le=1_000_000)
    max_prompt_tokens: int = Field(default=1_000_000, ge=1)
    max_concurrency: int = Field(default=512, ge=1, le=1_000_000)
    tokenize_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    prefill_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    decode_timeout_s: float = Field(default=600.0, gt=0, le=7200)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600)

    log_level: str = "INFO"

    @field_validator("prefill_engines", "decode_engines", mode="before")
    @classmethod
    def _parse_engines(cls, value: object) -> object:
        return _engines(value)

    @field_validator("tokenizers")
    @classmethod
    def _check_tokenizers(cls, value: dict[str, Path]) -> dict[str, Path]:
        for model, path in value.items():
            if not model or len(model) > 256:
                raise ValueError("tokenizers: model names must be 1..256 characters")
            if not path.is_dir():
                raise ValueError(f"tokenizers[{model!r}]: {str(path)!r} is not a directory")
        return value

    @field_validator("hash_secret_hex")
    @classmethod
    def _check_secret(cls, value: str) -> str:
        if value:
            kvsecret.parse(value, setting="KVBRIDGE_HASH_SECRET")
        return value.strip()
