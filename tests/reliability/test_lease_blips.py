"""A lease-manager blip costs no entries (issue 30, ADR 0024): the engines keep their node lease (their
incarnation) across a 7 s restart of the control plane on the embedded store, and across a lease-manager
failover to a standby replica, so the conversation's next turn reuses what D registered before the blip.
Before: each connector took a new node lease, the registry retired all of that engine's entries, the next
turn recomputed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .connector_stack import LONG, ConnectorStack, eventually

pytestmark = [pytest.mark.slow]


async def _blip(tmp_path: Path, how: str) -> None:
    stack = ConnectorStack(tmp_path / "data", standby_lease=how == "failover")
    await stack.start_services()
    try:
        await stack.start_engines()
        msgs = [{"role": "user", "content": LONG}]
        answer, verdict = await stack.turn(msgs, "c1")
        assert verdict.startswith("miss"), verdict
        await stack.wait_registered(1)
        plane = stack.d_connector().plane
        node_lease = plane._node_lease_id

        if how == "restart":
            await stack.stop_services()
            await asyncio.sleep(7)
            await stack.start_services()
            assert stack.services is not None and stack.services.lease is not None
            manager = stack.services.lease.manager
        else:
            elected = await stack.fail_over()
            print(f"failover: the standby leads {elected:.1f} s after the leader died")
            assert stack.standby is not None
            manager = stack.standby.manager
        await stack.wait_for_engines()
        # Both engines' connectors are back on the serving lease manager (P and D renew every TTL/3).
        took = await eventually(lambda: manager.renewals >= 4, "the engines renew at the serving lease manager")
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        answer, verdict = await stack.turn(msgs, "c1")
        print(
            f"{how}: engines renewing after {took:.1f} s; next turn {verdict}; D's node lease kept: "
            f"{plane._node_lease_id == node_lease}"
        )
        assert verdict.startswith("hit"), verdict
        assert plane._node_lease_id == node_lease  # the same incarnation
        assert answer == await stack.reference(msgs)
        assert await stack.unsafe_reads() == 0
    finally:
        await stack.stop_services()
        await stack.stop_engines()


async def test_a_control_plane_restart_costs_no_entries(tmp_path: Path) -> None:
    await _blip(tmp_path, "restart")


async def test_a_lease_manager_failover_costs_no_entries(tmp_path: Path) -> None:
    await _blip(tmp_path, "failover")
