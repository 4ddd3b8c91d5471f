"""kvbridge.ids (one rule per identifier kind) and kvbridge.secret (encoding, canary, signed fields)."""

from __future__ import annotations

import pytest

from kvbridge import ids
from kvbridge import secret as kvsecret
from kvbridge.errors import InvalidArgument


@pytest.mark.parametrize(
    ("rule", "good", "bad"),
    [
        (ids.TENANT, ["a", "a" * 128, "team-7.eu:x_y"], ["", "a" * 129, "acme corp", "a/b", "ü", "a\n"]),
        (ids.ENGINE_ID, ["decode-0", "10.0.0.5:8100"], ["", "d 0", "d/0"]),
        (ids.MODEL, ["Qwen/Qwen3-0.6B", "org/model@rev", "m" * 256], ["", "a b", "m" * 257, "\t", "ü"]),
        (ids.CONVERSATION_KEY, ["chat 42", " ", "~" * 256], ["", "k" * 257, "a\nb", "ü"]),
        (ids.ENGINE_REQUEST_ID, ["cmpl-1-0"], ["", "a b"]),
    ],
)
def test_rules(rule: ids.IdRule, good: list[str], bad: list[str]) -> None:
    for value in good:
        assert rule.valid(value) and rule.check("f", value) == value
    for value in bad:
        assert not rule.valid(value)
        with pytest.raises(InvalidArgument) as info:
            rule.check("entry.key.tenant", value)
        assert info.value.metadata == {"field": "entry.key.tenant"} and info.value.reason == "INVALID_FIELD"
    assert not rule.valid(None) and not rule.valid(7)
    assert rule.check_optional("f", "") == ""


def test_signature_is_deterministic_and_binds_every_signed_field() -> None:
    secret = bytes(range(32))
    base = {name: f"v-{name}" for name in kvsecret.SIGNED_FIELDS if name != kvsecret.ISSUED_AT}
    params = dict(base)
    kvsecret.sign_kv_params(secret, params, now=100.0)
    again = dict(base)
    kvsecret.sign_kv_params(secret, again, now=100.0)
    assert params == again and kvsecret.verify_kv_params(secret, params, accepted_at=100.0) == ""
    for name in kvsecret.SIGNED_FIELDS:
        changed = {**params, name: 101.0 if name == kvsecret.ISSUED_AT else "other"}
        assert kvsecret.verify_kv_params(secret, changed, accepted_at=100.0) == "bad_signature", name
    # Fields outside the signed set (vLLM's own, the traceparent) may change: vLLM rewrites some of them.
    assert kvsecret.verify_kv_params(secret, {**params, "do_remote_prefill": False}, accepted_at=100.0) == ""


def test_canary_is_short_public_and_distinct() -> None:
    a, b = kvsecret.canary(bytes(16)), kvsecret.canary(bytes(range(16)))
    assert a != b and len(a) == 16 and int(a, 16) >= 0
    cap = kvsecret.canary_capability(bytes(16))
    assert ids.CAPABILITY.valid(cap) and kvsecret.canary_of(["x", cap]) == a and kvsecret.canary_of(["x"]) is None
    assert len(bytes.fromhex(kvsecret.generate())) == 32


def test_a_pull_offer_signature_binds_every_field_p_acts_on_and_only_under_its_own_label() -> None:
    secret = bytes(range(32))
    offer: dict[str, object] = {
        name: f"v-{name}" for name in kvsecret.OFFER_SIGNED_FIELDS if name != kvsecret.OFFER_ISSUED_AT
    }
    offer["remote_block_ids"] = [[1, 2], [3, 4]]
    kvsecret.sign_pull_offer(secret, offer, now=100.0)
    assert kvsecret.verify_pull_offer(secret, offer, accepted_at=100.5) == ""
    for name in kvsecret.OFFER_SIGNED_FIELDS:
        changed = {**offer, name: 101.0 if name == kvsecret.OFFER_ISSUED_AT else "other"}
        assert kvsecret.verify_pull_offer(secret, changed, accepted_at=100.0) == "bad_signature", name
    assert kvsecret.verify_pull_offer(secret, {**offer, "remote_block_ids": [[2, 1], [3, 4]]}, accepted_at=100.0)
    assert kvsecret.verify_pull_offer(secret, {**offer, "traceparent": "00-x"}, accepted_at=100.0) == ""
    assert kvsecret.verify_pull_offer(secret, offer, accepted_at=100.0 + 61) == "expired"
    assert kvsecret.verify_pull_offer(None, offer, accepted_at=100.0) == "no_secret"
    unsigned = {k: v for k, v in offer.items() if k not in (kvsecret.OFFER_SIGNATURE, kvsecret.OFFER_ISSUED_AT)}
    assert kvsecret.verify_pull_offer(secret, unsigned, accepted_at=100.0) == "unsigned"
    # A decode request's signature is no pull offer's, and the reverse (separate labels and fields).
    both: dict[str, object] = {name: "x" for name in {*kvsecret.SIGNED_FIELDS, *kvsecret.OFFER_SIGNED_FIELDS}}
    kvsecret.sign_kv_params(secret, both, now=100.0)
    both[kvsecret.OFFER_SIGNATURE], both[kvsecret.OFFER_ISSUED_AT] = both[kvsecret.SIGNATURE], 100.0
    assert kvsecret.verify_pull_offer(secret, both, accepted_at=100.0) == "bad_signature"
