"""Engines trust only the gateway: the kvbridge_* fields of kv_transfer_params count only with the gateway's
signature under the deployment secret (kvbridge.secret). A field sent straight to an engine (a forged tenant,
an epoch of 2^63-1 that would block the conversation's future registrations) is ignored, counted and logged;
the request is served, not registered."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvbridge import secret as kvsecret
from kvbridge_connector import params as cparams
from kvbridge_services.gateway import kvparams

from .real_scheduler import FakeRequest, scheduler

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
NOW = 1_800_000_000.0
P_RETURNED = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
    "remote_request_id": "cmpl-p-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2]],
}


def _signed() -> dict[str, Any]:
    return kvparams.decode_params(
        dict(P_RETURNED), tenant="acme", conversation_key="c1", epoch=3, secret=SECRET, now=NOW
    )


def _ignored(reason: str) -> float:
    return float(cparams.IGNORED.labels(reason)._value.get())


def test_gateway_signed_fields_are_accepted() -> None:
    ref = cparams.parse_conversation(_signed(), "tiny", SECRET, accepted_at=NOW + 1)
    assert ref == cparams.ConversationRef(tenant="acme", model="tiny", conversation_key="c1", epoch=3)


@pytest.mark.parametrize(
    ("change", "value"),
    [
        (cparams.EPOCH, 2**63 - 1),
        (cparams.TENANT, "globex"),
        (cparams.CONVERSATION_KEY, "c2"),
        (cparams.MODEL, "other-model"),
        ("remote_request_id", "cmpl-p-2"),
        ("remote_engine_id", "p9"),
        (kvsecret.ISSUED_AT, NOW + 30),
    ],
)
def test_a_field_changed_after_signing_is_ignored(change: str, value: object) -> None:
    params = _signed()
    params[change] = value
    before = _ignored("bad_signature")
    assert cparams.parse_conversation(params, "tiny", SECRET, accepted_at=NOW + 1) is None
    assert _ignored("bad_signature") == before + 1


def test_unsigned_fields_sent_straight_to_an_engine_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    forged = {**P_RETURNED, cparams.TENANT: "acme", cparams.CONVERSATION_KEY: "c1", cparams.EPOCH: 2**63 - 1}
    before = _ignored("unsigned")
    cparams._last_logged.clear()
    with caplog.at_level(logging.WARNING, logger=cparams.log.name):
        assert cparams.parse_conversation(forged, "tiny", SECRET) is None
    assert _ignored("unsigned") == before + 1
    assert "ignoring the kvbridge_* fields" in caplog.text and "unsigned" in caplog.text


def test_another_secret_expired_or_no_secret_is_ignored() -> None:
    assert cparams.parse_conversation(_signed(), "tiny", OTHER, accepted_at=NOW) is None  # bad_signature
    before = _ignored("expired")
    late = NOW + kvsecret.DEFAULT_VALIDITY_S + 1
    assert cparams.parse_conversation(_signed(), "tiny", SECRET, accepted_at=late) is None
    assert (
        cparams.parse_conversation(_signed(), "tiny", SECRET, accepted_at=NOW - kvsecret.DEFAULT_CLOCK_SKEW_S - 1)
        is None
    )
    assert _ignored("expired") == before + 2
    assert cparams.parse_conversation(_signed(), "tiny", None, accepted_at=NOW) is None  # no_secret


def test_a_request_without_kvbridge_fields_is_not_counted() -> None:
    before = {r: _ignored(r) for r in ("unsigned", "bad_signature")}
    assert cparams.parse_conversation(dict(P_RETURNED), "tiny", SECRET) is None
    assert cparams.parse_conversation(None, "tiny", SECRET) is None
    assert {r: _ignored(r) for r in before} == before


def test_malformed_signature_fields_are_ignored_not_raised() -> None:
    for sig, issued in (("zz", NOW), (7, NOW), (None, NOW), ("ab", True), ("ab", "x"), ("ab", float("nan"))):
        params = _signed()
        params[kvsecret.SIGNATURE], params[kvsecret.ISSUED_AT] = sig, issued
        assert cparams.parse_conversation(params, "tiny", SECRET, accepted_at=NOW) is None
    params = _signed()
    params[cparams.EPOCH] = float("nan")  # JSON cannot encode it: refused, not an exception in vLLM's scheduler
    assert cparams.parse_conversation(params, "tiny", SECRET, accepted_at=NOW) is None


def test_p_returned_kvbridge_fields_are_not_passed_on_by_the_gateway() -> None:
    params = kvparams.decode_params(
        {**P_RETURNED, cparams.EPOCH: 2**63 - 1, kvsecret.SIGNATURE: "f" * 32},
        tenant="acme",
        conversation_key="c1",
        epoch=3,
        secret=SECRET,
        now=NOW,
    )
    assert params[cparams.EPOCH] == 3
    assert cparams.parse_conversation(params, "tiny", SECRET, accepted_at=NOW) is not None


class _Recorder:
    def __init__(self) -> None:
        self.commands: list[Any] = []

    def submit(self, command: Any) -> bool:
        self.commands.append(command)
        return True

    def drain(self, limit: int = 1024) -> list[Any]:
        return []

    def stop(self, timeout_s: float = 2.0) -> None:
        pass


def test_decode_engine_registers_only_gateway_signed_conversations(vllm_configs: dict[str, Any]) -> None:
    extra = {"kvbridge_registry": "127.0.0.1:1", "kvbridge_hash_secret": SECRET.hex(), "kvbridge_model": "tiny"}
    with scheduler(vllm_configs, "kv_consumer", extra) as sched:
        sched.control_plane.stop()
        sched.control_plane = recorder = _Recorder()
        base = {"do_remote_prefill": False, "do_remote_decode": False}
        forged = {**base, cparams.TENANT: "acme", cparams.CONVERSATION_KEY: "c1", cparams.EPOCH: 2**63 - 1}
        request = FakeRequest(
            "d-forged", forged, list(range(10, 110)), num_computed_tokens=128, output_token_ids=list(range(300, 340))
        )
        _, returned = sched.request_finished(request, ([1, 2, 3, 4],))
        assert not (returned or {}).get(cparams.RETAINED) and recorder.commands == []
        signed = kvparams.decode_params(base, tenant="acme", conversation_key="c1", epoch=1, secret=SECRET)
        request = FakeRequest(
            "d-signed", signed, list(range(10, 110)), num_computed_tokens=128, output_token_ids=list(range(300, 340))
        )
        _, returned = sched.request_finished(request, ([5, 6, 7, 8],))
        assert returned is not None and returned[cparams.RETAINED] is True
        assert [c.conversation.epoch for c in recorder.commands] == [1]
