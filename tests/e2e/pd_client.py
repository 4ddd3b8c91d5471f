"""A minimal P/D client for e2e tests: what a router does, with token-id prompts.

Turn: P runs the prompt with ``max_tokens=1`` and ``do_remote_decode`` (plus
D's params from the previous turn, if reusing); D pulls P's KV and generates.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from kvbridge import hashchain, offers
from kvbridge import secret as kvsecret
from tests.fixtures.vllm_engines import Engine

# The e2e deployment secret (tests/e2e/conftest.py HASH_SECRET is its hex).
E2E_SECRET = b"e2e-hash-secret-0123456789abcdef"

# The read window the tests give P, as the gateway does (kvbridge.offers): D's default offer window.
OFFER_TTL_MS = 5000
# Fields of D's returned params a router sends back to P for a reuse pull.
REUSE_FIELDS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    # Ids 8.. are plain words in the tiny tokenizer (0..7: specials and role words).
    return [rng.randrange(8, 512) for _ in range(count)]


def completion(engine: Engine, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return engine.post("/v1/completions", body)


@dataclass
class TurnResult:
    output_ids: list[int]
    prefill_params: dict[str, Any]  # P's returned kv_transfer_params
    decode_params: dict[str, Any]  # D's returned kv_transfer_params

    @property
    def pulled_tokens(self) -> int:
        return int(self.prefill_params.get("remote_prefill_cached_tokens") or 0)


def prefill_params_for(
    prompt: list[int],
    reuse: dict[str, Any] | None,
    verified: list[int] | None = None,
    offer_ttl_ms: int = OFFER_TTL_MS,
    offer_secret: bytes | None = E2E_SECRET,
) -> dict[str, Any]:
    """P's kv_transfer_params: plain, or pulling what ``reuse`` (D's params of an earlier turn) offers, with
    the prefix digest of ``verified`` (default: the prompt), as the gateway sends it for the tokens it verified,
    signed with ``offer_secret`` (None: unsigned, as from a caller that is not a gateway)."""
    if reuse is None:
        return {"do_remote_decode": True, "do_remote_prefill": False}
    params = {key: reuse[key] for key in REUSE_FIELDS if key in reuse}
    verified = prompt if verified is None else verified
    pulled = int(reuse.get("remote_num_tokens") or 0)
    if 0 < pulled <= len(verified):
        params[hashchain.KV_PARAMS_PREFIX_DIGEST] = hashchain.prefix_digest(verified, pulled)
    # As the gateway does right after a lookup: P must start its READ within the offer window (kvbridge.offers).
    params[offers.KV_PARAMS_OFFER_TTL_MS] = offer_ttl_ms
    if offer_secret is not None:
        kvsecret.sign_pull_offer(offer_secret, params, now=time.time())
    return params


def pd_turn(
    prefill: Engine,
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    *,
    reuse: dict[str, Any] | None = None,
    decode_extra: dict[str, Any] | None = None,
    verified: list[int] | None = None,
    secret: bytes | None = None,
    offer_ttl_ms: int = OFFER_TTL_MS,
    offer_secret: bytes | None = E2E_SECRET,
) -> TurnResult:
    """One disaggregated turn; ``reuse`` is D's params from an earlier turn (pull them back; see
    ``prefill_params_for``)."""
    p_response = completion(prefill, prompt, 1, prefill_params_for(prompt, reuse, verified, offer_ttl_ms, offer_secret))
    prefill_params = dict(p_response["kv_transfer_params"])
    d_params = dict(prefill_params)
    d_params.update(decode_extra or {})
    if secret is not None or any(k.startswith("kvbridge_") for k in decode_extra or {}):
        # As the gateway does: D's connector ignores unsigned kvbridge fields (default: the e2e secret).
        kvsecret.sign_kv_params(secret or E2E_SECRET, d_params, now=time.time())
    d_response = completion(decode, prompt, max_tokens, d_params)
    choice = d_response["choices"][0]
    return TurnResult(list(choice["token_ids"]), prefill_params, dict(d_response.get("kv_transfer_params") or {}))


def reference_output(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output computed locally on one engine: the no-reuse answer."""
    response = completion(engine, prompt, max_tokens, None)
    return list(response["choices"][0]["token_ids"])
