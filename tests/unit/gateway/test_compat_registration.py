"""Compatibility-mode registration is for stock decode engines only: a kvbridge connector on D registers its own
entry under its own lease and frees the blocks when that lease ends, so an entry of the gateway's would name
blocks D no longer holds (and supersede the connector's)."""

from __future__ import annotations

import pytest

from kvbridge.types.v1 import types_pb2
from kvbridge_services.gateway.engines import DECODE, EngineState
from kvbridge_services.gateway.registration import (
    ClockOffsets,
    Registration,
    RegistrationCheck,
    Skip,
    connector_registers,
    plan_registration,
)


def test_a_connector_engine_registers_its_own_entries() -> None:
    record = types_pb2.Engine(engine_id="d0", capabilities=["bidirectional_kv_xfer", "kvbridge_connector"])
    assert connector_registers(EngineState("http://d0", DECODE, record=record), {"do_remote_decode": True})
    # A record not known yet (static engine): the connector's mark on D's response says so.
    assert connector_registers(EngineState("http://d0", DECODE), {"kvbridge_retained": True})


def test_a_stock_engine_is_registered_by_the_gateway() -> None:
    record = types_pb2.Engine(engine_id="d0", capabilities=["bidirectional_kv_xfer"])
    assert not connector_registers(EngineState("http://d0", DECODE, record=record), {"do_remote_decode": True})
    assert not connector_registers(EngineState("http://d0", DECODE), {"kvbridge_retained": "yes"})
    assert not connector_registers(EngineState("http://d0", DECODE), None)


# -- what a stock D's returned params let the gateway register (plan_registration) -----------------------------
HOLD_S = 480.0


def returned(*, tokens: int = 40, engine_id: str = "d0", expiry: object = None) -> dict[str, object]:
    params: dict[str, object] = {
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": engine_id,
        "remote_request_id": "r1",
        "remote_num_tokens": tokens,
    }
    if expiry is not None:
        params["remote_blocks_expiry_time"] = expiry
    return params


def check(
    params: object, *, seq_len: int = 40, sent: float = 1000.0, now: float = 1001.0, engine_id: str = "d0"
) -> RegistrationCheck:
    engine = EngineState("http://d0", DECODE, engine_id=engine_id)
    return plan_registration(
        engine,
        params,
        seq_len,
        block_size=16,
        decode_sent_s=sent,
        decode_answered_s=sent + 0.5,
        now_s=now,
        hold_s=HOLD_S,
        entry_lease_ttl_s=60.0,
    )


def test_a_stock_d_that_retained_blocks_gets_an_entry_until_its_fixed_hold_ends() -> None:
    got = check(returned())
    assert isinstance(got.outcome, Registration)
    assert got.outcome.expire_s == 1000.0 + HOLD_S  # from when the decode was sent: D finished later
    assert got.outcome.full_blocks == 2  # 40 tokens: two whole 16-token blocks carry hashes
    assert got.outcome.lease_ttl_s == 60.0
    near_end = check(returned(), now=1000.0 + HOLD_S - 5.0 - 20.0)
    assert isinstance(near_end.outcome, Registration) and near_end.outcome.lease_ttl_s == pytest.approx(20.0)


def test_what_is_not_registered_says_why() -> None:
    assert check(None).outcome is Skip.NOTHING_RETAINED
    assert check({"do_remote_decode": False}).outcome is Skip.NOTHING_RETAINED
    assert check({**returned(), "kvbridge_retained": True}).outcome is Skip.CONNECTOR_REGISTERS
    mismatch = check(returned(engine_id="d9"))
    assert mismatch.outcome is Skip.ENGINE_MISMATCH and mismatch.engine_id == "d9"
    assert check(returned(), now=1000.0 + HOLD_S - 5.0).outcome is Skip.EXPIRED  # within the margin
    assert check(returned(tokens=15), seq_len=15).outcome is Skip.TOO_SHORT
    assert check(returned(tokens=400), seq_len=10).outcome is Skip.TOO_SHORT  # never more than the sequence


def test_ds_clock_is_learned_from_its_own_deadline_even_when_nothing_registers() -> None:
    # D's clock runs 100 s ahead: its deadline is its finish time + hold, which is before our receive time.
    got = check(returned(expiry=1000.5 + 100.0 + HOLD_S))
    assert got.clock_offset_low == pytest.approx(100.0)
    late = check(returned(expiry=1000.5 + 100.0 + HOLD_S), now=1000.0 + HOLD_S)
    assert late.outcome is Skip.EXPIRED and late.clock_offset_low == pytest.approx(100.0)
    assert check(returned(expiry=True)).clock_offset_low is None  # a bool is not a time
    assert check(returned(engine_id="d9", expiry=5.0)).clock_offset_low is None  # not this engine's clock


def test_clock_offsets_keep_the_largest_lower_bound_and_stay_bounded() -> None:
    clocks = ClockOffsets(max_engines=2)
    clocks.learn("d0", 3.0)
    clocks.learn("d0", 1.0)
    assert clocks.get("d0") == 3.0
    clocks.learn("d1", -2.0)
    clocks.learn("d2", 0.0)  # past the cap: the oldest row goes
    assert clocks.get("d0") is None and clocks.get("d1") == -2.0 and clocks.get("d2") == 0.0
    clocks.forget("d1")
    assert clocks.get("d1") is None


def test_nothing_is_registered_for_a_stock_engine_the_gateway_has_not_registered() -> None:
    # URL only and routed without registration (no engine id), or its registration pending or failed (ADR 0027):
    # its block size and NIXL identity are unknown, and the registry would refuse the entry.
    assert check(returned(), engine_id="").outcome is Skip.ENGINE_UNREGISTERED
    pending = EngineState("http://d0", DECODE, engine_id="d0", pending_registration=True)
    got = plan_registration(
        pending,
        returned(),
        40,
        block_size=16,
        decode_sent_s=1000.0,
        decode_answered_s=1000.5,
        now_s=1001.0,
        hold_s=HOLD_S,
        entry_lease_ttl_s=60.0,
    )
    assert got.outcome is Skip.ENGINE_UNREGISTERED
