"""The deployment secret: one value, one encoding, shared by every gateway replica and every connector.

It keys three things, each under its own label so no output of one is an input of another:

- the block-hash chain (:mod:`kvbridge.hashchain`): the secret itself is the BLAKE2b key;
- the *canary*: a short HMAC of a fixed label, which a connector puts in its engine registration
  (capability ``kvbridge-secret:<canary>``) so a gateway can tell, before any reuse, that both hold the same
  secret (different secrets give different chains: 0 % reuse and no error);
- the signature over the ``kvbridge_*`` fields a gateway sends a decode engine inside ``kv_transfer_params``
  (:func:`sign_kv_params`, :func:`verify_kv_params`): an engine trusts those fields only from a gateway;
- the signature over a *pull offer* a gateway sends a prefill engine (:func:`sign_pull_offer`,
  :func:`verify_pull_offer`): which of D's blocks to READ, for how many tokens, the prompt-prefix digest and
  the read window. P pulls only a signed offer, so no other HTTP caller can make it READ D's blocks (another
  tenant's KV) or stretch the read window past D's promise.

Encoding: hex, 32..128 digits (16..64 bytes), e.g. ``openssl rand -hex 32``. Anything else is refused with an
error naming the setting, never reinterpreted (the gateway used to read hex and the connector raw text: the
same string gave two secrets).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvbridge import hashchain, offers

# The one setting name (connector: also kv_connector_extra_config.kvbridge_hash_secret).
ENV = "KVBRIDGE_HASH_SECRET"
CANARY_CAPABILITY_PREFIX = "kvbridge-secret:"
_CANARY_LABEL = b"kvbridge/v1 deployment-secret canary"
_SIGN_LABEL = b"kvbridge/v1 kv_transfer_params\x00"
_CANARY_HEX_DIGITS = 16  # 64 bits: a mismatch check, not a credential

# The kvbridge_* fields of a decode request's kv_transfer_params and the fields binding them to one transfer.
TENANT = "kvbridge_tenant"
CONVERSATION_KEY = "kvbridge_conversation_key"
EPOCH = "kvbridge_epoch"
MODEL = "kvbridge_model"
ISSUED_AT = "kvbridge_issued_at"  # Unix seconds (float) when the gateway signed
SIGNATURE = "kvbridge_signature"  # hex HMAC-SHA256 (128 bits kept)
# Added by D's kvbridge connector to the params D returns once it retains the turn's blocks under its own lease
# (unsigned: it only tells the gateway a registration is coming, never what to trust).
RETAINED = "kvbridge_retained"
# The request identity: the prefill request whose KV this decode request reads (P's returned params).
_BOUND = ("remote_engine_id", "remote_request_id")
SIGNED_FIELDS = (TENANT, CONVERSATION_KEY, EPOCH, MODEL, *_BOUND, ISSUED_AT)
# A pull offer to P: the blocks to READ (vLLM's remote_* fields), the digest P checks, the read window.
OFFER_ISSUED_AT = "kvbridge_offer_issued_at"
OFFER_SIGNATURE = "kvbridge_offer_signature"
_OFFER_LABEL = b"kvbridge/v1 pull offer\x00"
OFFER_SIGNED_FIELDS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    hashchain.KV_PARAMS_PREFIX_DIGEST,
    offers.KV_PARAMS_OFFER_TTL_MS,
    offers.KV_PARAMS_SOURCE_INCARNATION,
    OFFER_ISSUED_AT,
)
# How long a signature is good for, counted from signing to the engine accepting the request (both clocks).
DEFAULT_VALIDITY_S = 60.0
DEFAULT_CLOCK_SKEW_S = 30.0


def parse(text: str, *, setting: str = ENV) -> bytes:
    """The secret from its hex text; ValueError naming ``setting`` for anything that is not 32..128 hex digits."""
    value = text.strip()
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(
            f"{setting} must be hex (e.g. `openssl rand -hex 32`); got {len(value)} characters that are not hex digits"
        ) from None
    if not hashchain.MIN_SECRET_BYTES <= len(raw) <= hashchain.MAX_SECRET_BYTES:
        raise ValueError(
            f"{setting} must be {2 * hashchain.MIN_SECRET_BYTES}..{2 * hashchain.MAX_SECRET_BYTES} "
            f"hex digits ({hashchain.MIN_SECRET_BYTES}..{hashchain.MAX_SECRET_BYTES} bytes); "
            f"got {len(raw)} bytes"
        )
    return raw


def generate() -> str:
    """A fresh secret's hex text (development stacks; production sets one for the whole deployment)."""
    return secrets.token_hex(32)


def canary(secret: bytes) -> str:
    """A short public fingerprint of the secret (one-way; equal exactly when the secrets are equal, in practice)."""
    return hmac.new(hashchain.check_secret(secret), _CANARY_LABEL, hashlib.sha256).hexdigest()[:_CANARY_HEX_DIGITS]


def canary_capability(secret: bytes) -> str:
    """The engine capability announcing the secret's canary (fits kvbridge.ids.CAPABILITY)."""
    return CANARY_CAPABILITY_PREFIX + canary(secret)


def canary_of(capabilities: Iterable[str]) -> str | None:
    """The canary an engine announced, or None (an engine without a kvbridge connector, or an older one)."""
    for cap in capabilities:
        if cap.startswith(CANARY_CAPABILITY_PREFIX):
            return cap[len(CANARY_CAPABILITY_PREFIX) :]
    return None


@dataclass(frozen=True, slots=True)
class _Scheme:
    """One kind of signed params: its label, the fields it binds, and where the time and signature go."""

    label: bytes
    fields: tuple[str, ...]
    issued_at: str
    signature: str

    def mac(self, secret: bytes, params: Mapping[str, Any]) -> str:
        # JSON of a fixed-order list: no field can run into the next; absent fields are null.
        message = (
            self.label
            + json.dumps(
                [params.get(name) for name in self.fields], separators=(",", ":"), ensure_ascii=True, allow_nan=False
            ).encode()
        )
        return hmac.new(hashchain.check_secret(secret), message, hashlib.sha256).hexdigest()[:32]

    def sign(self, secret: bytes, params: MutableMapping[str, Any], *, now: float) -> None:
        """Adds the signing time and the signature over the scheme's fields to ``params``, in place. Sign last:
        any later change voids it."""
        params[self.issued_at] = round(now, 3)
        params[self.signature] = self.mac(secret, params)

    def verify(
        self,
        secret: bytes | None,
        params: Mapping[str, Any],
        *,
        accepted_at: float,
        validity_s: float = DEFAULT_VALIDITY_S,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    ) -> str:
        """Why the signed fields of ``params`` must be ignored ("" when a gateway sharing ``secret`` signed
        exactly these values): ``no_secret``, ``unsigned``, ``bad_signature`` or ``expired``. ``accepted_at``:
        when the engine received the request (Unix seconds), not when it looks at the params."""
        if secret is None:
            return "no_secret"
        signature, issued = params.get(self.signature), params.get(self.issued_at)
        if signature is None and issued is None:
            return "unsigned"
        if not isinstance(signature, str) or isinstance(issued, bool) or not isinstance(issued, int | float):
            return "bad_signature"
        try:
            expected = self.mac(secret, params)
        except (TypeError, ValueError):  # a field JSON cannot encode (NaN, an object): not what a gateway sends
            return "bad_signature"
        if not hmac.compare_digest(signature, expected):
            return "bad_signature"
        if not issued - clock_skew_s <= accepted_at <= issued + validity_s:
            return "expired"
        return ""


# The two schemes' public functions are their bound methods (same arguments, keyword-only after ``params``).
# Decode requests: the kvbridge fields and the transfer they belong to (P's ``remote_engine_id`` /
# ``remote_request_id``); an engine trusts those fields only from a gateway.
_DECODE = _Scheme(_SIGN_LABEL, SIGNED_FIELDS, ISSUED_AT, SIGNATURE)
sign_kv_params = _DECODE.sign
verify_kv_params = _DECODE.verify
# Pull offers to P (``OFFER_SIGNED_FIELDS``: the source engine and request, its address, the block ids, the
# token count, D's expiry, the prefix digest and the read window): P pulls only what a gateway signed.
_OFFER = _Scheme(_OFFER_LABEL, OFFER_SIGNED_FIELDS, OFFER_ISSUED_AT, OFFER_SIGNATURE)
sign_pull_offer = _OFFER.sign
verify_pull_offer = _OFFER.verify


__all__ = [
    "CANARY_CAPABILITY_PREFIX",
    "DEFAULT_VALIDITY_S",
    "ENV",
    "OFFER_ISSUED_AT",
    "OFFER_SIGNATURE",
    "OFFER_SIGNED_FIELDS",
    "SIGNED_FIELDS",
    "canary",
    "canary_capability",
    "canary_of",
    "generate",
    "parse",
    "sign_kv_params",
    "sign_pull_offer",
    "verify_kv_params",
    "verify_pull_offer",
]
