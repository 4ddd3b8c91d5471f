"""Compatibility-mode registration is for stock decode engines only: a kvbridge connector on D registers its own
entry under its own lease and frees the blocks when that lease ends, so an entry of the gateway's would name
blocks D no longer holds (and supersede the connector's)."""

from __future__ import annotations

from kvbridge.types.v1 import types_pb2
from kvbridge_services.gateway.engines import DECODE, EngineState
from kvbridge_services.gateway.router import _connector_registers


def test_a_connector_engine_registers_its_own_entries() -> None:
    record = types_pb2.Engine(engine_id="d0", capabilities=["bidirectional_kv_xfer", "kvbridge_connector"])
    assert _connector_registers(EngineState("http://d0", DECODE, record=record), {"do_remote_decode": True})
    # A record not known yet (static engine): the connector's mark on D's response says so.
    assert _connector_registers(EngineState("http://d0", DECODE), {"kvbridge_retained": True})


def test_a_stock_engine_is_registered_by_the_gateway() -> None:
    record = types_pb2.Engine(engine_id="d0", capabilities=["bidirectional_kv_xfer"])
    assert not _connector_registers(EngineState("http://d0", DECODE, record=record), {"do_remote_decode": True})
    assert not _connector_registers(EngineState("http://d0", DECODE), {"kvbridge_retained": "yes"})
    assert not _connector_registers(EngineState("http://d0", DECODE), None)
