"""Prefill's own checks before a pull (real scheduler half): a gateway signed the offer, the verified prefix's
digest matches P's prompt, and the read window has not passed."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from kvbridge import hashchain, offers
from kvbridge import secret as kvsecret
from tests.fixtures.common import VLLM_HINT, require

from .real_scheduler import FakeRequest, scheduler

require("vllm", VLLM_HINT)

PROMPT = list(range(10, 210))
SECRET = bytes.fromhex("00112233445566778899aabbccddeeff")
EXTRA = {"kvbridge_hash_secret": SECRET.hex()}
_UNSET = object()


def _offer(
    digest_tokens: list[int] | None,
    tokens: int = 96,
    *,
    secret: bytes | None = SECRET,
    issued: float | None = None,
    overrides: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """An offer as the gateway sends it, signed with ``secret`` (None: unsigned) after ``overrides`` (a value of
    ``_UNSET`` removes the field)."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "decode-0",
        "remote_request_id": "d-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3]],
        "remote_num_tokens": tokens,
        "tp_size": 1,
        offers.KV_PARAMS_OFFER_TTL_MS: 5000,
    }
    if digest_tokens is not None:
        params[hashchain.KV_PARAMS_PREFIX_DIGEST] = hashchain.prefix_digest(digest_tokens, tokens)
    params.update(overrides or {})
    params = {k: v for k, v in params.items() if v is not _UNSET}
    if secret is not None:
        kvsecret.sign_pull_offer(secret, params, now=time.time() if issued is None else issued)
    return params


def test_a_matching_digest_pulls(vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        request = FakeRequest("ok", _offer(PROMPT), PROMPT)
        assert sched.get_num_new_matched_tokens(request, 0) == (96, True)
        assert request.kv_transfer_params["remote_block_ids"] == [[1, 2, 3]]


@pytest.mark.parametrize(
    ("offer", "why"),
    [
        (_offer([*PROMPT[:50], 7, *PROMPT[51:]]), "a token inside the pulled prefix differs"),
        (_offer(None), "no digest"),
        (_offer(PROMPT, overrides={hashchain.KV_PARAMS_PREFIX_DIGEST: 12}), "a digest of the wrong type"),
        (_offer(PROMPT, overrides={"remote_num_tokens": 500}), "more tokens than the prompt has"),
    ],
)
def test_a_mismatching_or_missing_digest_declines_and_never_contacts_d(
    vllm_configs: dict[str, Any], offer: dict[str, Any], why: str
) -> None:
    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        request = FakeRequest("bad", offer, PROMPT)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False), why
        # Without block ids vLLM's update_state_after_alloc neither reads from nor notifies D.
        assert "remote_block_ids" not in request.kv_transfer_params
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # asked again: still no pull


@pytest.mark.parametrize(
    ("ttl", "why"),
    [
        (None, "no read deadline"),
        (0, "a zero window"),
        (-5, "a negative window"),
        ("5000", "a window of the wrong type"),
        (10**9, "an unbounded window"),
    ],
)
def test_an_offer_without_a_valid_read_deadline_declines(vllm_configs: dict[str, Any], ttl: object, why: str) -> None:
    offer = _offer(PROMPT, overrides={offers.KV_PARAMS_OFFER_TTL_MS: _UNSET if ttl is None else ttl})
    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        request = FakeRequest("no-deadline", offer, PROMPT)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False), why
        assert "remote_block_ids" not in request.kv_transfer_params


def test_an_offer_that_waited_in_the_queue_past_its_deadline_declines(vllm_configs: dict[str, Any]) -> None:
    """D frees a withdrawn entry's blocks once the offer window has passed: a READ after it could read reused KV."""
    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        fresh = FakeRequest("fresh", _offer(PROMPT), PROMPT)
        assert sched.get_num_new_matched_tokens(fresh, 0) == (96, True)
        queued = FakeRequest("queued", _offer(PROMPT), PROMPT, arrival_time=time.time() - 4.9)
        assert sched.get_num_new_matched_tokens(queued, 0) == (0, False)
        assert "remote_block_ids" not in queued.kv_transfer_params
        # Asked first in time, again after the deadline (still waiting for a slot): declined then.
        waiting = FakeRequest("waiting", _offer(PROMPT), PROMPT, arrival_time=time.time() - 4.0)
        assert sched.get_num_new_matched_tokens(waiting, 0) == (96, True)
        waiting.arrival_time -= 1.0
        assert sched.get_num_new_matched_tokens(waiting, 0) == (0, False)


def test_the_read_deadline_travels_to_the_worker(vllm_configs: dict[str, Any]) -> None:
    from kvbridge_connector.scheduler import META_READ_BY

    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        request = FakeRequest("ok", _offer(PROMPT), PROMPT)
        assert sched.get_num_new_matched_tokens(request, 0) == (96, True)
        sched._reqs_need_recv.clear()
        meta = sched.build_connector_meta(_empty_scheduler_output())
        assert getattr(meta, META_READ_BY) == {"ok": pytest.approx(request.arrival_time + 5.0)}
        assert getattr(sched.build_connector_meta(_empty_scheduler_output()), META_READ_BY) == {}


def _empty_scheduler_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def test_routers_without_digests_can_be_allowed_explicitly(vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_producer", {**EXTRA, "kvbridge_require_prefix_digest": False}) as sched:
        assert sched.get_num_new_matched_tokens(FakeRequest("plain", _offer(None), PROMPT), 0) == (96, True)
        wrong = FakeRequest("wrong", _offer([*PROMPT[:50], 7, *PROMPT[51:]]), PROMPT)
        assert sched.get_num_new_matched_tokens(wrong, 0) == (0, False)  # a digest given is still checked


@pytest.mark.parametrize(
    ("offer", "reason"),
    [
        (_offer(PROMPT, secret=None), "unsigned_offer"),
        (_offer(PROMPT, secret=bytes(range(16))), "forged_offer"),
        ({**_offer(PROMPT), "remote_block_ids": [[7, 8, 9]]}, "forged_offer"),
        ({**_offer(PROMPT), offers.KV_PARAMS_OFFER_TTL_MS: 300_000}, "forged_offer"),
        ({**_offer(PROMPT), "remote_engine_id": "decode-other"}, "forged_offer"),
        (_offer(PROMPT, issued=time.time() - 120), "stale_offer"),
    ],
    ids=["unsigned", "another-secret", "other-blocks", "longer-window", "other-engine", "signed-long-ago"],
)
def test_an_offer_no_gateway_signed_declines_and_never_contacts_d(
    vllm_configs: dict[str, Any], offer: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Any HTTP caller of P can write vLLM's remote_* fields: only the gateway's signature makes P READ."""
    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        request = FakeRequest("unsigned", offer, PROMPT)
        with caplog.at_level("WARNING"):
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        assert "remote_block_ids" not in request.kv_transfer_params
        assert reason in caplog.text


def test_signed_offers_are_optional_only_when_switched_off(vllm_configs: dict[str, Any]) -> None:
    """kvbridge_require_signed_offer: false (a router that is not the gateway); without a secret P pulls nothing
    by default."""
    with scheduler(vllm_configs, "kv_producer", {**EXTRA, "kvbridge_require_signed_offer": False}) as sched:
        assert sched.get_num_new_matched_tokens(FakeRequest("r", _offer(PROMPT, secret=None), PROMPT), 0) == (96, True)
    with scheduler(vllm_configs, "kv_producer", {}) as sched:
        assert sched.get_num_new_matched_tokens(FakeRequest("s", _offer(PROMPT), PROMPT), 0) == (0, False)


def test_a_new_incarnation_of_a_source_engine_makes_the_worker_drop_its_nixl_state(
    vllm_configs: dict[str, Any],
) -> None:
    """vLLM caches a decode engine's NIXL handshake by engine id: after D restarts under the same id every READ
    with the old process's registrations would fail. An offer naming another incarnation (D's node lease) tells
    the worker to drop that state before the READ; the first sighting and the same incarnation do not."""
    from kvbridge_connector.scheduler import META_FORGET_ENGINES

    incarnation = offers.KV_PARAMS_SOURCE_INCARNATION

    def pull(sched: Any, name: str, value: int) -> set[str]:
        request = FakeRequest(name, _offer(PROMPT, overrides={incarnation: value}), PROMPT)
        assert sched.get_num_new_matched_tokens(request, 0) == (96, True)
        sched._reqs_need_recv.clear()
        return set(getattr(sched.build_connector_meta(_empty_scheduler_output()), META_FORGET_ENGINES))

    with scheduler(vllm_configs, "kv_producer", EXTRA) as sched:
        assert pull(sched, "first", 11) == set()
        assert pull(sched, "same", 11) == set()
        assert pull(sched, "restarted", 12) == {"decode-0"}
        assert pull(sched, "after", 12) == set()
        # The incarnation is signed with the rest of the offer: changing it voids the signature.
        forged = {**_offer(PROMPT, overrides={incarnation: 12}), incarnation: 13}
        assert sched.get_num_new_matched_tokens(FakeRequest("forged", forged, PROMPT), 0) == (0, False)
