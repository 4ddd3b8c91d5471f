"""vLLM ``kv_transfer_params`` as the gateway builds and reads them (NixlConnector, pull mode).

Field names follow vLLM 0.32 ``nixl/pull_scheduler.py`` (``request_finished`` builds them, the
scheduler's ``get_num_new_matched_tokens`` reads them). Network coordinates always come from the
registry's Engine record, never from a client.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge import hashchain, offers
from kvbridge import secret as kvsecret
from kvbridge import telemetry as tel

# Extra keys the gateway adds for D so a kvbridge connector there can register the new state (signed).
CONVERSATION_KEY_PARAM = kvsecret.CONVERSATION_KEY
TENANT_PARAM = kvsecret.TENANT
EPOCH_PARAM = kvsecret.EPOCH
# Never passed on from P's params: only this gateway sets (and signs) them.
_SIGNED_KVBRIDGE_FIELDS = frozenset(
    name for name in (*kvsecret.SIGNED_FIELDS, kvsecret.SIGNATURE) if name.startswith("kvbridge_")
)

_INTERNAL_BODY_KEYS = ("kv_transfer_params", "conversation_id")


# The engines' prefix caches are isolated per tenant (docs/security.md, "Engines' prefix caches"): every request
# an engine gets carries a cache_salt derived from the tenant and the client's own cache_salt, keyed by the
# deployment secret, so no tenant can time another's prompts through a shared prefix-cache hit.
_CACHE_SALT_LABEL = b"kvbridge/v1 tenant cache_salt\x00"
ENGINE_CACHE_SALT_PREFIX = "kvb1-"
_U32 = struct.Struct("<I")


def cache_salt_key(secret: bytes) -> bytes:
    """The key of :func:`engine_cache_salt`: the deployment secret under its own label (no output of the chain's,
    the canary's or a signature's hash is ever an engine's salt, nor the other way round)."""
    return hmac.new(secret, _CACHE_SALT_LABEL, hashlib.sha256).digest()


def _lp(text: str) -> bytes:
    data = text.encode("utf-8")
    return _U32.pack(len(data)) + data


def engine_cache_salt(key: bytes, tenant: str, client_salt: str) -> str:
    """The ``cache_salt`` every engine request of ``tenant`` carries: vLLM starts a request's prefix-cache hash
    chain from it, so two tenants (or one tenant's two client salts) never share a cached block. A keyed hash of
    (tenant, client salt), length-prefixed so no two pairs give the same input: other tenants cannot compute it,
    and the engine never sees the tenant's name in it, nor the client's salt. The same for every turn of the
    tenant with that client salt (on every gateway replica sharing the secret), so reuse within a tenant is
    unchanged: the gateway hashes its block-hash chain under this value, as D's connector does (it hashes under
    the request's cache_salt)."""
    mac = hmac.new(key, _lp(tenant) + _lp(client_salt), hashlib.sha256).hexdigest()
    return ENGINE_CACHE_SALT_PREFIX + mac[:32]  # 128 bits


def _with_traceparent(params: dict[str, Any]) -> dict[str, Any]:
    """Adds the current span's ``traceparent`` (the turn) so the connector's spans join the turn's trace."""
    traceparent = tel.current_traceparent()
    if traceparent:
        params[tel.KV_PARAMS_TRACEPARENT] = traceparent
    return params


def strip_client_params(body: dict[str, Any]) -> dict[str, Any]:
    """The body without anything a client may not choose (kv_transfer_params, our own keys)."""
    return {k: v for k, v in body.items() if k not in _INTERNAL_BODY_KEYS}


def _all_ints(values: Sequence[object]) -> bool:
    """Every value a plain int (JSON integers; not bool): one C-level pass, not a Python call per block id."""
    return set(map(type, values)) <= _INT_ONLY


_INT_ONLY = frozenset({int})


def block_groups(raw: object) -> list[list[int]]:
    """``remote_block_ids`` as a list of groups; vLLM sends one list per KV group (older: one flat list)."""
    if not isinstance(raw, list | tuple):
        raise ValueError("remote_block_ids must be a list")
    if _all_ints(raw):
        return [list(raw)]
    groups: list[list[int]] = []
    for group in raw:
        if not isinstance(group, list | tuple) or not _all_ints(group):
            raise ValueError("remote_block_ids groups must be lists of integers")
        groups.append(list(group))
    return groups


def truncate_groups(groups: Sequence[Sequence[int]], tokens: int, block_size: int) -> list[list[int]]:
    """Each group's block ids cut to the blocks that hold the first ``tokens`` tokens (a whole number of blocks)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if tokens % block_size:
        raise ValueError("tokens must be a whole number of blocks")
    n = tokens // block_size
    out = []
    for group in groups:
        if len(group) < n:
            raise ValueError(f"a KV group holds {len(group)} blocks, fewer than the {n} needed")
        out.append(list(group[:n]))
    return out


def reusable_tokens(verified: int, prompt_len: int, block_size: int) -> int:
    """Tokens P may pull: the verified prefix, floored to a block, leaving P at least one token to compute."""
    if prompt_len <= 1:
        return 0
    cap = ((prompt_len - 1) // block_size) * block_size
    return max(0, min((verified // block_size) * block_size, cap))


@dataclass(frozen=True, slots=True)
class PullSource:
    """Where D's retained KV is (from the registry's Location and Engine records)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_groups: list[list[int]]
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    # Unix time after which the blocks may be gone; None when unknown.
    expiry_time: float | None = None
    # The engine's offer window (Engine.offer_window) and when the lookup that found the blocks was answered
    # (time.monotonic()): P gets what is left of the window to start its READ (kvbridge.offers).
    offer_window_s: float | None = None
    looked_up_at: float = 0.0
    # The engine's incarnation (its registry record's node lease id; 0: unknown): P re-handshakes with an engine
    # id it sees under a new incarnation (kvbridge.offers.KV_PARAMS_SOURCE_INCARNATION).
    incarnation: int = 0


def plain_prefill_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False}


def local_prefill_params() -> dict[str, Any]:
    """D's params for a turn sent straight to the holder D (placement's local prefill): no remote prefill, no
    remote decode, so vLLM's NIXL connector loads nothing (``get_num_new_matched_tokens`` returns 0 and D's
    prefix cache serves the history) yet, being non-empty, the params make ``request_finished`` treat the
    request as D's and retain its blocks (bidirectional transfer), returning D's params as after any decode:
    the kvbridge connector registers the new state, or the gateway does (compatibility mode)."""
    return {"do_remote_decode": False, "do_remote_prefill": False}


def reuse_prefill_params(
    source: PullSource, tokens: int, block_size: int, *, prompt_ids: Sequence[int], secret: bytes
) -> dict[str, Any]:
    """P's params: produce KV for a remote decode, and pull the first ``tokens`` tokens' KV from D
    (with the digest of the verified prompt prefix, which P checks against its own prompt). The offer is
    signed with the deployment ``secret``: P pulls nothing it did not get from a gateway."""
    params: dict[str, Any] = {
        **plain_prefill_params(),
        "remote_engine_id": source.engine_id,
        "remote_request_id": source.request_id,
        "remote_host": source.host,
        "remote_port": source.port,
        "remote_block_ids": truncate_groups(source.block_groups, tokens, block_size),
        "remote_num_tokens": tokens,
        "tp_size": max(1, source.tp_size),
        "pp_size": max(1, source.pp_size),
        "dcp_size": max(1, source.dcp_size),
        # P recomputes it over its own prompt before pulling (docs/hash-chain.md, "Prompt-prefix digest").
        hashchain.KV_PARAMS_PREFIX_DIGEST: hashchain.prefix_digest(prompt_ids, tokens),
    }
    if source.expiry_time is not None:
        params["remote_blocks_expiry_time"] = source.expiry_time
    if source.offer_window_s is not None:
        params[offers.KV_PARAMS_OFFER_TTL_MS] = offer_ttl_ms(source)
    if source.incarnation:
        params[offers.KV_PARAMS_SOURCE_INCARNATION] = source.incarnation
    kvsecret.sign_pull_offer(secret, params, now=time.time())
    return _with_traceparent(params)


def offer_ttl_ms(source: PullSource) -> int:
    """What is left of the engine's offer window since the lookup (<= 0: too late to offer the blocks)."""
    if source.offer_window_s is None:
        return 0
    return offers.offer_ttl_ms(source.offer_window_s, time.monotonic() - source.looked_up_at)


def decode_params(
    prefill_returned: dict[str, Any],
    *,
    tenant: str,
    conversation_key: str,
    epoch: int,
    secret: bytes,
    now: float | None = None,
) -> dict[str, Any]:
    """D's params: what P returned, plus the conversation identity for a connector on D, signed with the
    deployment secret (D's connector ignores kvbridge fields without this gateway's signature)."""
    params = {k: v for k, v in prefill_returned.items() if k not in _SIGNED_KVBRIDGE_FIELDS}
    params[TENANT_PARAM] = tenant
    params[CONVERSATION_KEY_PARAM] = conversation_key
    params[EPOCH_PARAM] = epoch
    kvsecret.sign_kv_params(secret, params, now=time.time() if now is None else now)
    return _with_traceparent(params)


def check_prefill_returned(params: object) -> dict[str, Any]:
    """P's returned params, if they are what D needs; ValueError otherwise."""
    if not isinstance(params, dict):
        raise ValueError("prefill response carries no kv_transfer_params")
    if not params.get("do_remote_prefill"):
        raise ValueError("prefill params lack do_remote_prefill")
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"):
        if key not in params:
            raise ValueError(f"prefill params lack {key}")
    return params


@dataclass(frozen=True, slots=True)
class Retained:
    """What D retained after a turn (its returned params, compatibility mode)."""

    engine_id: str
    request_id: str
    block_groups: list[list[int]]
    token_count: int


def retained_from_decode(params: object, sequence_len: int) -> Retained | None:
    """D's retained blocks from its returned params, or None when D kept nothing."""
    if not isinstance(params, dict) or not params.get("do_remote_decode"):
        return None
    try:
        groups = block_groups(params.get("remote_block_ids"))
        engine_id = params["remote_engine_id"]
        request_id = params["remote_request_id"]
        num = int(params.get("remote_num_tokens") or 0)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(engine_id, str) or not isinstance(request_id, str) or not groups or not groups[0]:
        return None
    return Retained(engine_id, request_id, groups, min(num, sequence_len))
