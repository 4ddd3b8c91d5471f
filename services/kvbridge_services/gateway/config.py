"""Gateway settings (env prefix ``KVBRIDGE_GATEWAY_``), read only by the composition root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvbridge import secret as kvsecret


class StaticEngine(BaseModel):
    """An engine given by configuration rather than found in the registry.

    The gateway registers it in the registry under a node lease it keeps alive, so a stock vLLM engine serves reuse
    (compatibility mode, ADR 0027): what is not configured here (``model``, ``block_size``, ``engine_id``,
    ``kv_host``, ``kv_port``) is learned from the engine itself (gateway/discovery.py), and an engine that does not
    state it fails the gateway's start. ``register_in_registry``: None follows the gateway's
    ``register_static_engines`` (true by default); false routes it without registering it (plain routing, or
    another gateway replica registers it).
    """

    url: str
    model: str = ""
    engine_id: str = ""
    kv_host: str = ""
    kv_port: int = Field(default=0, ge=0, lt=65536)
    block_size: int = Field(default=0, ge=0, le=1024)
    register_in_registry: bool | None = None

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

    host: str = Field(
        default="127.0.0.1",
        description=(
            "Bind address of the HTTP and gRPC front doors (loopback unless API keys are set or KVBRIDGE_INSECURE=1)."
        ),
    )
    http_port: int = Field(
        default=8080, ge=0, lt=65536, description="OpenAI-compatible HTTP (and SSE) front door; 0: any free port."
    )
    grpc_port: int = Field(
        default=50053, ge=0, lt=65536, description="gRPC GatewayService front door; 0: any free port."
    )

    # Control plane (gRPC only).
    registry_address: str = Field(
        default="127.0.0.1:50051",
        description="Registry host:port; empty: run without a control plane (no reuse, plain P/D routing).",
    )
    lease_address: str = Field(
        default="127.0.0.1:50052",
        description="Lease manager host:port (or a list, ipv4:a,b); NOT_LEADER answers are followed to the leader.",
    )
    # Connections to the registry, used in turn: more than one spreads lookups over a registry replica's
    # server processes (KVBRIDGE_REGISTRY_SERVE_PROCESSES; SO_REUSEPORT spreads connections, not calls).
    registry_connections: int = Field(default=1, ge=1, le=64)
    # API key the gateway presents to registry and lease manager (its gateway role there): KVBRIDGE_API_KEY, the
    # one service key of the stack, unless KVBRIDGE_GATEWAY_CONTROL_API_KEY overrides it.
    control_api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("control_api_key", "KVBRIDGE_GATEWAY_CONTROL_API_KEY", "KVBRIDGE_API_KEY"),
    )
    control_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=30,
        description=(
            "Deadline of each registry and lease-manager call a turn makes (lookup, consume, grant); past it the turn"
            " goes on without reuse."
        ),
    )

    # Client API keys (JSON, see kvbridge_services.common.auth): KVBRIDGE_API_KEYS_FILE, the one keys file of the stack
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
    prefill_engines: Annotated[list[StaticEngine], NoDecode] = Field(
        default_factory=list,
        description=(
            "Prefill engines given by configuration: a comma-separated URL list, or a JSON list of URLs or of "
            '{"url", "model", "engine_id", "kv_host", "kv_port", "block_size", "register_in_registry"}. '
            "The gateway registers each (compatibility mode: stock vLLM with NixlConnector) and learns what is not"
            " given from the engine: model (/v1/models), block_size (/metrics vllm:cache_config_info), engine_id,"
            " kv_host, kv_port (the kv_transfer_params of a one-token probe); an engine that answers without them"
            " fails the start. register_in_registry false: routed without registering it."
        ),
    )
    decode_engines: Annotated[list[StaticEngine], NoDecode] = Field(
        default_factory=list, description="Decode engines given by configuration, like prefill_engines."
    )
    register_static_engines: bool = Field(
        default=True,
        description=(
            "Register the engines of prefill_engines/decode_engines in the registry (compatibility mode, ADR 0027)"
            " unless an engine says register_in_registry; false: route them without registering them (plain P/D"
            " routing, or one other gateway replica registers them and this one learns them from the registry)."
        ),
    )
    engines_from_registry: bool = Field(
        default=True,
        description=(
            "Also route to the engines registered in the registry (connector mode: engines register themselves)."
        ),
    )
    registry_refresh_s: float = Field(
        default=5.0, gt=0, le=600, description="How often the registry's engine list is read again."
    )
    health_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="How often every engine's /health is checked (and /v1/models, /metrics for load).",
    )
    health_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Deadline of each health check; a failed check takes the engine out of rotation until a good one.",
    )
    # Weight of vLLM's KV usage (0..1) against outstanding requests in the load score.
    kv_usage_weight: float = Field(default=4.0, ge=0, le=1000)

    # Reuse policy.
    reuse_enabled: bool = Field(default=True, description="Pull verified KV at all; false: every turn recomputes.")
    reuse_threshold_tokens: int = Field(
        default=64,
        ge=1,
        le=10_000_000,
        description=(
            "Fewest verified tokens worth a pull; a shorter verified prefix is recomputed (declined:below_threshold)."
        ),
    )
    default_block_size: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="KV block size assumed for an engine that does not report one (a stock engine without block_size).",
    )
    # Compatibility mode: stock vLLM, no connector: the gateway registers entries from D's responses.
    compat_registration: bool = True
    # Stock vLLM frees D's blocks when P reads them: an entry of an engine without the kvbridge connector serves
    # one prefill, taken in the registry (an atomic consume) before P pulls, so it holds across gateway replicas.
    single_use_entries: bool = True
    # The stock decode engines' decoder_kv_blocks_ttl (vLLM kv_connector_extra_config, default 480 s): how long
    # D holds a finished request's blocks. A gateway-registered entry expires this long after its decode request
    # went out; renewals never extend it. Must not exceed the engines' own value.
    compat_decoder_kv_blocks_ttl_s: float = Field(default=480.0, gt=0, le=86_400)
    entry_lease_ttl_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description=(
            "TTL of the entry lease the gateway grants for a compatibility-mode registration (renewed by the "
            "conversation's turns and heartbeats, never past D's hold)."
        ),
    )
    registration_wait_s: float = Field(
        default=0.5,
        ge=0,
        le=10,
        description=(
            "How long after a conversation's turn ended its next turn's lookup may wait for that turn's entry (D's"
            " connector registers it off the engine's loop; compatibility mode registers it after the answer), so"
            " an agent whose tool answers in milliseconds still reuses; a turn that comes later never waits. 0: off."
        ),
    )
    # Placement (docs/gateway.md "Placement", ADR 0020): where each turn runs, by a cost model.
    placement: bool = Field(
        default=False,
        description=(
            "Route each turn by the placement cost model: decode on the D that holds the conversation (its prefix"
            " cache serves the history, P sends only the new suffix) unless its load exceeds the cap, and choose per"
            " turn among recompute, pull to P and a local prefill on the holder from measured prefill speed,"
            " bandwidth and load; the reuse threshold is then one block (the model decides). false: today's"
            " least-loaded D and the fixed reuse_threshold_tokens."
        ),
    )
    placement_local_prefill: bool = Field(
        default=True,
        description=(
            "With placement on, whether a turn may be sent straight to the holder D as a plain request (its prefix"
            " cache holds the history: no P, no transfer); false: only recompute or pull to P."
        ),
    )
    placement_prefill_s_per_token: float = Field(
        default=1e-4,
        gt=0,
        le=1,
        description=(
            "Prefill seconds per token assumed for an engine until the gateway has timed its prefills (a decaying"
            " least-squares fit of each P's plain prefill calls replaces it; a decode engine's local prefill is"
            " taken to run at the mean of the measured P figures)."
        ),
    )
    placement_attention_s_per_token_pair: float = Field(
        default=0.0,
        ge=0,
        le=1e-3,
        description=(
            "Quadratic (attention) prefill term: seconds per new token per context token (new x (cached + new/2));"
            " configured, not measured; 0: prefill is linear in new tokens."
        ),
    )
    placement_kv_bytes_per_token: int = Field(
        default=131_072,
        ge=1,
        le=64 * 1024 * 1024,
        description=(
            "KV cache bytes per token of the served model (layers x KV heads x head dim x 2 x dtype bytes; 128 KiB"
            " is Llama-3-8B in bf16): what a pull of one token moves."
        ),
    )
    placement_pull_bytes_per_s: float = Field(
        default=10e9,
        ge=1e6,
        le=1e13,
        description=(
            "Pull (NIXL READ) bandwidth assumed until measured: each P's timed prefills, plain and pulling, are fitted"
            " together (per-call overhead, seconds per computed token, seconds per pulled token)."
        ),
    )
    placement_pull_fixed_s: float = Field(
        default=0.002,
        ge=0,
        le=10,
        description="Per-transfer latency added to every pull estimate (handshake, notification); configured.",
    )
    placement_decode_load_weight: float = Field(
        default=0.05,
        ge=0,
        le=100,
        description=(
            "How much each decode in flight on the holder D slows its local prefill (x the prefill's own time): a"
            " decode adds one token and its KV reads to each step the prefill shares; each local prefill already in"
            " flight there counts 1 (they queue)."
        ),
    )
    placement_holder_max_extra_load: float = Field(
        default=4.0,
        ge=0,
        le=1_000_000,
        description=(
            "The holder D is chosen only while its load score (outstanding requests + kv_usage_weight x KV usage)"
            " exceeds the least-loaded D's by at most this; beyond it the turn decodes elsewhere"
            " (holder_overloaded)."
        ),
    )
    placement_figure_weight: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Weight of each new sample in the measured figures (exponential decay of older ones).",
    )

    # Reuse for turns without a conversation key (ADR 0022): each is registered under a keyless thread's key and
    # its next turn finds it by content (the same verification and tenant scope as a keyed turn).
    content_lookup: bool = True
    # Keyed lookups answered from the gateway's own WatchEntries-fed copy of the registry's entries (ADR 0008):
    # no round trip before the prefill. Only hits are answered from it, only while it is in sync (a message
    # within entry_mirror_stale_after_s); the rest go to the registry. Beyond max_entries, entries stay
    # registry-only. An entry of an 8K-token conversation is ~4 KB (hash checkpoints and block ids), so the default
    # bounds the copy near 200 MB.
    entry_mirror: bool = True
    entry_mirror_max_entries: int = Field(
        default=50_000,
        ge=1,
        le=10_000_000,
        description=(
            "Most entries the gateway's copy of the registry holds; beyond it lookups of the rest go to the registry."
        ),
    )
    entry_mirror_stale_after_s: float = Field(
        default=3.0,
        ge=0.3,
        le=300,
        description=(
            "The copy answers no hit once it has heard nothing from the registry's watch (event or progress) for this"
            " long."
        ),
    )

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
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024, description="Largest HTTP request body (413 past it)."
    )
    max_messages: int = Field(
        default=2048, ge=1, le=1_000_000, description="Most chat messages in one request (400 past it)."
    )
    max_prompt_tokens: int = Field(
        default=1_000_000, ge=1, description="Most prompt tokens in one request (400 past it)."
    )
    max_concurrency: int = Field(
        default=512, ge=1, le=1_000_000, description="Turns in flight at once; one more is refused with 429 OVERLOADED."
    )
    max_tenant_concurrency: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description=(
            "HTTP turns in flight at once per tenant (429 OVERLOADED past it), beside max_concurrency, so one tenant"
            " cannot take every slot; a single-tenant deployment sets it to max_concurrency."
        ),
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Deadline for reading an HTTP request's body once its headers arrived (408 past it).",
    )
    stored_responses_per_tenant: int = Field(
        default=10_000,
        ge=0,
        le=10_000_000,
        description="Responses API: stored responses kept per tenant (least recently used go first; 0: none stored).",
    )
    stored_responses_mb_per_tenant: int = Field(
        default=64,
        ge=0,
        le=65_536,
        description="Responses API: MiB of stored responses per tenant, each counted with its whole thread.",
    )
    stored_responses_total_mb: int = Field(
        default=1024, ge=0, le=1_048_576, description="Responses API: MiB of stored responses over all tenants."
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description=(
            "Deadline for an HTTP request's headers, from the connection's start or the request's first byte;"
            " past it the connection is closed (408)."
        ),
    )
    keep_alive_timeout_s: int = Field(
        default=5, ge=1, le=3600, description="An idle HTTP keep-alive connection is closed after this many seconds."
    )
    tokenize_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Deadline of P's /tokenize call (when the gateway does not tokenize locally).",
    )
    prefill_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="Deadline of the prefill request; a pull that times out is retried once without reuse.",
    )
    decode_timeout_s: float = Field(
        default=600.0, gt=0, le=7200, description="Deadline of the decode request (504 past it)."
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600, description="TCP connect deadline towards an engine.")

    log_level: str = Field(default="INFO", description="Python logging level of the gateway process.")

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
