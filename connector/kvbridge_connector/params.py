"""The kvbridge fields the gateway passes inside vLLM's ``kv_transfer_params``.

vLLM forwards ``kv_transfer_params`` from the HTTP request to the connector
untouched, so the gateway adds these next to vLLM's own fields on the decode
request. They are validated here; a request with missing or bad fields is
served normally, only not registered.

Any HTTP caller of the engine can put fields in ``kv_transfer_params``, so the
connector trusts them only with the gateway's signature (kvbridge.secret: an
HMAC under the deployment secret over the fields and the prefill request they
belong to, good for a minute): unsigned or forged fields (an epoch of 2^63-1
that would block the conversation's future registrations, another tenant) are
ignored, with a log line and ``kvbridge_connector_kv_params_ignored_total``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from kvbridge import hashchain, ids
from kvbridge import secret as kvsecret

log = logging.getLogger(__name__)

CONVERSATION_KEY = kvsecret.CONVERSATION_KEY
TENANT = kvsecret.TENANT
EPOCH = kvsecret.EPOCH
# Optional: overrides the served model name used in the hash chain and entry key.
MODEL = kvsecret.MODEL
_IDENTITY = (CONVERSATION_KEY, TENANT, EPOCH, MODEL)
# kvbridge fields ignored for want of a valid gateway signature, by reason (kvbridge.secret.verify_kv_params).
IGNORED = Counter(
    "kvbridge_connector_kv_params_ignored_total",
    "Decode requests whose kvbridge_* kv_transfer_params were ignored (unsigned, forged, expired)",
    ["reason"],
)
_LOG_EVERY_S = 10.0
_last_logged: dict[str, float] = {}

# Added by the connector to D's returned params once it retains blocks under kvbridge.
RETAINED = kvsecret.RETAINED

_EPOCH_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ConversationRef:
    tenant: str
    model: str
    conversation_key: str
    epoch: int


def parse_conversation(
    params: Mapping[str, Any] | None, default_model: str, secret: bytes | None, *, accepted_at: float | None = None
) -> ConversationRef | None:
    """The conversation a decode request belongs to, or None when not (validly, with the gateway's signature
    under ``secret``) given. ``accepted_at``: when the engine received the request (Unix s; default now)."""
    if not params or not any(name in params for name in _IDENTITY):
        return None  # a request no gateway marked for kvbridge: nothing to ignore
    when = time.time() if accepted_at is None else accepted_at
    problem = kvsecret.verify_kv_params(secret, params, accepted_at=when)
    if problem:
        _ignored(problem)
        return None
    key, tenant, epoch = params.get(CONVERSATION_KEY), params.get(TENANT), params.get(EPOCH)
    model = params.get(MODEL) or default_model
    if not ids.CONVERSATION_KEY.valid(key) or not ids.TENANT.valid(tenant) or not ids.MODEL.valid(model):
        return None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch <= _EPOCH_MAX:
        return None
    return ConversationRef(tenant=tenant, model=model, conversation_key=key, epoch=epoch)


def _ignored(reason: str) -> None:
    IGNORED.labels(reason).inc()
    now = time.monotonic()
    if now - _last_logged.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S:  # at most one line per reason per 10 s
        _last_logged[reason] = now
        log.warning(
            "kvbridge: ignoring the kvbridge_* fields of a decode request (%s): only a gateway holding "
            "this engine's deployment secret may set them; the request is served, not registered",
            reason,
        )


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


# Why a pull offer's signature is refused (kvbridge.secret.verify_pull_offer), as the decline reason P reports.
_OFFER_DECLINES = {
    "no_secret": "no_secret",
    "unsigned": "unsigned_offer",
    "bad_signature": "forged_offer",
    "expired": "stale_offer",
}


def pull_offer_problem(params: Mapping[str, Any], secret: bytes | None, *, accepted_at: float) -> str:
    """Why P must not pull an offer that no gateway sharing ``secret`` signed ("" when one did): another HTTP
    caller could otherwise make P READ any of D's blocks (another tenant's KV) or stretch the read window."""
    problem = kvsecret.verify_pull_offer(secret, params, accepted_at=accepted_at)
    return _OFFER_DECLINES.get(problem, problem)
