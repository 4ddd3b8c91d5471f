from __future__ import annotations

import time

import pytest

from kvbridge import hashchain
from kvbridge import secret as kvsecret
from kvbridge_services.gateway import kvparams
from kvbridge_services.gateway.reuse import NoReuse, ReuseVerdict


def test_truncate_cuts_every_group_to_k_over_b() -> None:
    groups = [[1, 2, 3, 4, 5], [10, 11, 12, 13, 14]]
    assert kvparams.truncate_groups(groups, 48, 16) == [[1, 2, 3], [10, 11, 12]]


def test_truncate_rejects_partial_blocks_and_short_groups() -> None:
    with pytest.raises(ValueError):
        kvparams.truncate_groups([[1, 2]], 40, 16)
    with pytest.raises(ValueError):
        kvparams.truncate_groups([[1, 2]], 48, 16)


def test_reusable_tokens_floors_to_blocks_and_leaves_one_token_to_compute() -> None:
    assert kvparams.reusable_tokens(100, 200, 16) == 96
    assert kvparams.reusable_tokens(128, 128, 16) == 112  # a full-prompt hit keeps the last block for P
    assert kvparams.reusable_tokens(64, 1, 16) == 0


SECRET = bytes(range(16))


def test_reuse_prefill_params_use_only_the_source_record() -> None:
    src = kvparams.PullSource(engine_id="d0", request_id="r1", host="10.0.0.5", port=5600, block_groups=[[7, 8, 9, 10]])
    prompt = list(range(40))
    p = kvparams.reuse_prefill_params(src, 32, 16, prompt_ids=prompt, secret=SECRET)
    assert p["do_remote_decode"] is True and p["do_remote_prefill"] is False
    assert p[hashchain.KV_PARAMS_PREFIX_DIGEST] == hashchain.prefix_digest(prompt, 32)
    assert p["remote_block_ids"] == [[7, 8]] and p["remote_num_tokens"] == 32
    assert (p["remote_engine_id"], p["remote_request_id"], p["remote_host"], p["remote_port"]) == (
        "d0",
        "r1",
        "10.0.0.5",
        5600,
    )
    # Signed last, over everything P acts on: P pulls only what a gateway sharing the secret offered.
    assert kvsecret.verify_pull_offer(SECRET, p, accepted_at=time.time()) == ""
    assert kvsecret.verify_pull_offer(bytes(16), p, accepted_at=time.time()) == "bad_signature"


def test_p_gets_what_is_left_of_the_engines_offer_window() -> None:
    import time

    from kvbridge import offers

    looked_up = time.monotonic() - 1.5
    src = kvparams.PullSource(
        engine_id="d0",
        request_id="r1",
        host="h",
        port=1,
        block_groups=[[7, 8]],
        offer_window_s=5.0,
        looked_up_at=looked_up,
    )
    ttl = kvparams.reuse_prefill_params(src, 32, 16, prompt_ids=list(range(40)), secret=SECRET)[
        offers.KV_PARAMS_OFFER_TTL_MS
    ]
    assert 3300 <= ttl <= 3500
    assert (
        kvparams.offer_ttl_ms(
            kvparams.PullSource("d0", "r1", "h", 1, [[7]], offer_window_s=1.0, looked_up_at=looked_up)
        )
        <= 0
    )
    no_promise = kvparams.PullSource(engine_id="d0", request_id="r1", host="h", port=1, block_groups=[[7, 8]])
    assert offers.KV_PARAMS_OFFER_TTL_MS not in kvparams.reuse_prefill_params(
        no_promise, 32, 16, prompt_ids=list(range(40)), secret=SECRET
    )


def test_strip_client_params() -> None:
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}, "conversation_id": "c", "top_p": 1}
    assert kvparams.strip_client_params(body) == {"model": "m", "top_p": 1}


def test_block_groups_accepts_flat_and_grouped() -> None:
    assert kvparams.block_groups([1, 2]) == [[1, 2]]
    assert kvparams.block_groups([[1], [2]]) == [[1], [2]]
    with pytest.raises(ValueError):
        kvparams.block_groups([[1], "x"])
    for bad in ([[1, True]], [[1, 2.0]], [[1, "3"]], [[1], [None]]):  # bool, float, str: not block ids
        with pytest.raises(ValueError):
            kvparams.block_groups(bad)
    assert kvparams.block_groups([]) == [[]] and kvparams.block_groups([[]]) == [[]]


def test_retained_from_decode() -> None:
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [[5, 6]],
        "remote_engine_id": "d0",
        "remote_request_id": "r",
        "remote_num_tokens": 30,
    }
    r = kvparams.retained_from_decode(params, 25)
    assert r is not None and r.token_count == 25 and r.block_groups == [[5, 6]]
    assert kvparams.retained_from_decode({"do_remote_decode": False}, 10) is None
    assert kvparams.retained_from_decode(None, 10) is None


def test_decode_params_carry_conversation_identity_signed() -> None:
    secret = bytes(range(16))
    p = kvparams.decode_params(
        {"do_remote_prefill": True}, tenant="acme", conversation_key="c1", epoch=3, secret=secret
    )
    assert p[kvparams.TENANT_PARAM] == "acme" and p[kvparams.CONVERSATION_KEY_PARAM] == "c1"
    assert p[kvparams.EPOCH_PARAM] == 3
    assert kvsecret.verify_kv_params(secret, p, accepted_at=time.time()) == ""
    assert kvsecret.verify_kv_params(bytes(16), p, accepted_at=time.time()) == "bad_signature"


def test_verdict_header_format() -> None:
    assert ReuseVerdict(None, 96).header() == "hit;tokens=96"
    assert ReuseVerdict(NoReuse.NOT_FOUND).header() == "miss;tokens=0"
    assert ReuseVerdict(NoReuse.EXPIRED, 64).header() == "declined:expired;tokens=64"
