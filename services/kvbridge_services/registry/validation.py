"""Validation of the registry's request fields: entries, lookups, engines. Raises kvbridge.errors
(INVALID_FIELD / TOO_LARGE). Identifiers: kvbridge.ids; the checks services share:
kvbridge_services.common.validation."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge import ids
from kvbridge.errors import invalid_field
from kvbridge.hashchain import HASH_BYTES, MAX_BLOCK_SIZE
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.hashrecord import PackedChain
from kvbridge_services.common.validation import too_large

HOST_RE = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]|[0-9A-Fa-f:]{2,45}")
URL_RE = re.compile(r"https?://[!-~]{1,2040}")
MAX_CAPABILITIES = 64
MAX_PARALLEL = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    max_blocks_per_chain: int = 32768
    max_kv_groups: int = 16


DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000


def check_block_size(field: str, value: int) -> int:
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise invalid_field(field, f"must be 1..{MAX_BLOCK_SIZE}")
    return value


def check_hashes(field: str, hashes: Sequence[bytes], limits: Limits) -> None:
    if len(hashes) > limits.max_blocks_per_chain:
        raise too_large(field, f"at most {limits.max_blocks_per_chain} block hashes")
    if hashes and set(map(len, hashes)) != {HASH_BYTES}:  # one C-level pass; find the culprit only on error
        i = next(i for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
        raise invalid_field(f"{field}[{i}]", f"block hashes are exactly {HASH_BYTES} bytes")


def blocks_for(token_count: int, block_size: int) -> int:
    return -(-token_count // block_size)


def check_entry_for_register(entry: registry_pb2.Entry, limits: Limits) -> None:
    """Every field of an Entry a decode engine registers (tenant handled by the caller)."""
    ids.TENANT.check_optional("entry.key.tenant", entry.key.tenant)
    ids.MODEL.check("entry.key.model", entry.key.model)
    ids.CONVERSATION_KEY.check("entry.key.conversation_key", entry.key.conversation_key)
    ids.ENGINE_ID.check("entry.engine_id", entry.engine_id)
    ids.ENGINE_REQUEST_ID.check("entry.engine_request_id", entry.engine_request_id)
    bs = check_block_size("entry.block_size", entry.block_size)
    if entry.token_count < 1:
        raise invalid_field("entry.token_count", "must be >= 1")
    blocks = blocks_for(entry.token_count, bs)
    if blocks > limits.max_blocks_per_chain:
        raise too_large("entry.token_count", f"at most {limits.max_blocks_per_chain} blocks per entry")
    if not entry.block_ids:
        raise invalid_field("entry.block_ids", "at least one KV-cache group is required")
    if len(entry.block_ids) > limits.max_kv_groups:
        raise too_large("entry.block_ids", f"at most {limits.max_kv_groups} KV-cache groups")
    for g, group in enumerate(entry.block_ids):
        if len(group.ids) != blocks:
            raise invalid_field(
                f"entry.block_ids[{g}]", f"has {len(group.ids)} ids; token_count/block_size needs {blocks}"
            )
    hashes = entry.block_hashes  # the repeated field itself: copying 1,000s of hashes into a list costs µs
    check_hashes("entry.block_hashes", hashes, limits)
    full_blocks = entry.token_count // bs
    if full_blocks == 0:
        raise invalid_field("entry.token_count", "an entry needs at least one full block")
    if len(hashes) != full_blocks:
        raise invalid_field(
            "entry.block_hashes", f"need {full_blocks} hashes, one per full block of the retained tokens"
        )
    if entry.chain_stride not in (0, 1):
        raise invalid_field("entry.chain_stride", "a registration carries the whole chain (0 or 1)")
    if entry.tail_block_hashes or entry.tail_start_block:
        field = "entry.tail_block_hashes" if entry.tail_block_hashes else "entry.tail_start_block"
        raise invalid_field(field, "set by the registry from block_hashes; leave it empty")
    if entry.final_block_hash and entry.final_block_hash != hashes[-1]:
        raise invalid_field("entry.final_block_hash", "must be empty or equal the last block hash")
    if entry.lease_id == 0:
        raise invalid_field("entry.lease_id", "required")
    if entry.epoch == 0:
        raise invalid_field("entry.epoch", "must be >= 1")
    if entry.HasField("expire_time") and not 0 <= entry.expire_time.nanos < 1_000_000_000:
        raise invalid_field("entry.expire_time", "not a valid timestamp")


def check_register_request(request: registry_pb2.RegisterEntryRequest, limits: Limits) -> None:
    ids.REQUEST_ID.check("request_id", request.request_id)
    if not request.HasField("entry"):
        raise invalid_field("entry", "required")
    check_entry_for_register(request.entry, limits)


def check_lookup_request(request: registry_pb2.LookupEntryRequest, limits: Limits) -> Sequence[bytes]:
    """Validates the request; returns the prompt's chain from whichever of the two forms was sent."""
    ids.TENANT.check_optional("tenant", request.tenant)
    ids.MODEL.check("model", request.model)
    if request.conversation_key:
        ids.CONVERSATION_KEY.check("conversation_key", request.conversation_key)
    check_block_size("block_size", request.block_size)
    packed = request.block_hashes_packed
    if not packed:
        hashes = list(request.block_hashes)
        check_hashes("block_hashes", hashes, limits)
        return hashes
    if len(request.block_hashes):
        raise invalid_field("block_hashes_packed", "set exactly one of block_hashes and block_hashes_packed")
    if len(packed) % HASH_BYTES:
        raise invalid_field("block_hashes_packed", f"length must be a multiple of {HASH_BYTES} (one hash per block)")
    if len(packed) // HASH_BYTES > limits.max_blocks_per_chain:
        raise too_large("block_hashes_packed", f"at most {limits.max_blocks_per_chain} block hashes")
    return PackedChain(packed, HASH_BYTES)


def check_entry_key(field: str, key: registry_pb2.EntryKey) -> None:
    ids.TENANT.check_optional(f"{field}.tenant", key.tenant)
    ids.MODEL.check(f"{field}.model", key.model)
    ids.CONVERSATION_KEY.check(f"{field}.conversation_key", key.conversation_key)


def check_engine(engine: types_pb2.Engine, limits: Limits) -> None:
    ids.ENGINE_ID.check("engine.engine_id", engine.engine_id)
    if engine.role not in types_pb2.EngineRole.values() or engine.role == types_pb2.ENGINE_ROLE_UNSPECIFIED:
        raise invalid_field("engine.role", "required")
    ids.MODEL.check("engine.model", engine.model)
    if engine.http_url and not URL_RE.fullmatch(engine.http_url):
        raise invalid_field("engine.http_url", "must be an http(s) URL of printable ASCII, at most 2048 chars")
    if not HOST_RE.fullmatch(engine.kv_host):
        raise invalid_field("engine.kv_host", "must be a host name or IP address")
    if not 1 <= engine.kv_port <= 65535:
        raise invalid_field("engine.kv_port", "must be 1..65535")
    for name in ("dp_size", "tp_size", "pp_size", "dcp_size"):
        if getattr(engine, name) > MAX_PARALLEL:
            raise invalid_field(f"engine.{name}", f"must be <= {MAX_PARALLEL}")
    if engine.dp_size and engine.dp_rank >= engine.dp_size:
        raise invalid_field("engine.dp_rank", "must be < dp_size")
    check_block_size("engine.block_size", engine.block_size)
    if not 1 <= engine.kv_group_count <= limits.max_kv_groups:
        raise invalid_field("engine.kv_group_count", f"must be 1..{limits.max_kv_groups}")
    if len(engine.capabilities) > MAX_CAPABILITIES:
        raise too_large("engine.capabilities", f"at most {MAX_CAPABILITIES}")
    for i, cap in enumerate(engine.capabilities):
        ids.CAPABILITY.check(f"engine.capabilities[{i}]", cap)
    if engine.node_lease_id == 0:
        raise invalid_field("engine.node_lease_id", "required: the engine's liveness lease")
