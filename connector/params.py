"""The kvbridge fields the gateway passes inside vLLM's ``kv_transfer_params``.

vLLM forwards ``kv_transfer_params`` from the HTTP request to the connector
untouched, so the gateway adds these next to vLLM's own fields on the decode
request. They are validated here; a request with missing or bad fields is
served normally, only not registered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge import hashchain, ids

CONVERSATION_KEY = "kvbridge_conversation_key"
TENANT = "kvbridge_tenant"
EPOCH = "kvbridge_epoch"
# Optional: overrides the served model name used in the hash chain and entry key.
MODEL = "kvbridge_model"

# Added by the connector to D's returned params once it retains blocks under kvbridge.
RETAINED = "kvbridge_retained"

_EPOCH_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ConversationRef:
    tenant: str
    model: str
    conversation_key: str
    epoch: int


def parse_conversation(params: Mapping[str, Any] | None, default_model: str) -> ConversationRef | None:
    """The conversation a decode request belongs to, or None when not (validly) given."""
    if not params:
        return None
    key, tenant, epoch = params.get(CONVERSATION_KEY), params.get(TENANT), params.get(EPOCH)
    model = params.get(MODEL) or default_model
    if not ids.CONVERSATION_KEY.valid(key) or not ids.TENANT.valid(tenant) or not ids.MODEL.valid(model):
        return None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch <= _EPOCH_MAX:
        return None
    return ConversationRef(tenant=tenant, model=model, conversation_key=key, epoch=epoch)


def prompt_prefix_problem(params: Mapping[str, Any], prompt_token_ids: Sequence[int], *, required: bool) -> str:
    """Why P must not pull what ``params`` offer for this prompt ("" when it may): the gateway's digest
    of the verified prefix must match P's own first ``remote_num_tokens`` prompt tokens."""
    digest = params.get(hashchain.KV_PARAMS_PREFIX_DIGEST)
    if digest is None:
        return "no_prefix_digest" if required else ""
    tokens = params.get("remote_num_tokens")
    if not isinstance(digest, str) or isinstance(tokens, bool) or not isinstance(tokens, int):
        return "bad_prefix_digest"
    if not 0 < tokens <= len(prompt_token_ids):
        return "bad_prefix_digest"
    return "" if hashchain.prefix_digest(prompt_token_ids, tokens) == digest else "prompt_mismatch"
