"""A repaired or restored embedded store is a new generation: nothing from the older one is offered (issue 30,
ADR 0024).

acme's conversation is registered by D's connector; then closed (entry deleted, lease revoked, D frees the
blocks after the grace). The store is then rolled back to a state that still holds the entry, its lease and D's
node lease: by ``kvbridge store repair`` after a bit flipped in the record after the registration, or by a backup
copy of the data directory taken before the close. The control plane restarts on the rolled-back files while
the engines keep running. acme's next turn must not reuse the old entry (its blocks are no longer held: the
simulator counts such a read as unsafe), its answer equals the no-reuse answer, and reuse comes back once D
registered the turn after it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.cli import main as kvbridge
from kvbridge_services.common.store.wal import _HEADER, LOG_NAME

from .connector_stack import LONG, MODEL, ConnectorStack, eventually

pytestmark = [pytest.mark.slow]


async def _rolled_back(tmp_path: Path, how: str) -> None:
    data = tmp_path / "data"
    stack = ConnectorStack(data)
    await stack.start_services()
    try:
        await stack.start_engines()
        msgs = [{"role": "user", "content": LONG}]
        answer, verdict = await stack.turn(msgs, "c1")
        assert verdict.startswith("miss"), verdict
        await stack.wait_registered(1)
        offset = (data / LOG_NAME).stat().st_size  # the next record is the first one after the registration
        backup = tmp_path / "backup"
        shutil.copytree(data, backup)  # a backup copy of the live directory

        await stack.delete_entry("acme", "c1")
        await stack.wait_held(0)  # D freed the blocks (lease end confirmed + grace)
        # Another tenant's turns take the freed blocks.
        for n in range(2):
            await stack.turn([{"role": "user", "content": f"globex document {n} " + LONG}], f"g{n}", "key-globex")
        await stack.stop_services()
        # The operator's repair or restore takes a while: the engines' reconnect backoff grows meanwhile (on the
        # code before generations, D re-registering under a new node lease was all that ended the old entry).
        await asyncio.sleep(7)

        if how == "repair":
            log = data / LOG_NAME
            raw = bytearray(log.read_bytes())
            assert len(raw) > offset + _HEADER.size + 4, "records follow the registration"
            raw[offset + _HEADER.size + 3] ^= 0x01
            log.write_bytes(bytes(raw))
            assert kvbridge(["store", "repair", "--data-dir", str(data)]) == 0
        else:
            shutil.rmtree(data)
            shutil.copytree(backup, data)

        await stack.start_services()
        await stack.wait_for_engines()
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        answer2, verdict = await stack.turn(msgs, "c1")
        unsafe, reference = await stack.unsafe_reads(), await stack.reference(msgs)
        print(
            f"{how}: acme's first turn after the rollback: {verdict}, unsafe reads {unsafe}, "
            f"answer {'equal to' if answer2 == reference else 'DIFFERENT from'} no reuse"
        )
        assert not verdict.startswith("hit"), verdict
        assert unsafe == 0
        assert answer2 == reference
        assert stack.store is not None and stack.store.retired > 0  # the older generation's soft state went

        # What D registers from now on is offered again: reuse comes back, never unsafe.
        verdicts = []
        for n in range(4):
            registered = stack.d_connector().registered
            msgs = [*msgs, {"role": "assistant", "content": answer2}, {"role": "user", "content": f"more {n}"}]
            answer2, verdict = await stack.turn(msgs, "c1")
            verdicts.append(verdict)
            assert answer2 == await stack.reference(msgs)
            if verdict.startswith("hit"):
                break
            await stack.wait_registered(registered + 1)
        print(f"{how}: later turns {verdicts}")
        assert verdicts[-1].startswith("hit"), verdicts
        assert await stack.unsafe_reads() == 0
    finally:
        await stack.stop_services()
        await stack.stop_engines()


async def test_a_repaired_store_offers_nothing_of_the_older_generation(tmp_path: Path) -> None:
    await _rolled_back(tmp_path, "repair")


async def test_a_restored_backup_copy_offers_nothing_of_the_older_generation(tmp_path: Path) -> None:
    await _rolled_back(tmp_path, "copy")


async def test_a_live_lease_of_d_that_d_does_not_hold_is_revoked(tmp_path: Path) -> None:
    """The connector's second line against a rollback nobody declared: an entry lease of its engine that this
    process was not granted (here granted behind its back, as a restored one would be) is revoked within
    2 x the RPC deadline + 1 s of the lease watch showing it; D's own lease is left alone."""
    stack = ConnectorStack(tmp_path / "data")
    await stack.start_services()
    try:
        await stack.start_engines()
        msgs = [{"role": "user", "content": LONG}]
        answer, _ = await stack.turn(msgs, "c1")
        await stack.wait_registered(1)
        assert stack.services is not None and stack.services.lease is not None
        manager = stack.services.lease.manager
        [own] = [r.lease_id for r in manager.table.leases.values() if r.conversation_key == "c1"]
        async with grpc.aio.insecure_channel(stack.services.lease.address) as channel:
            ghost = await lease_pb2_grpc.LeaseServiceStub(channel).GrantLease(
                lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_ENTRY,
                    tenant="acme",
                    engine_id="d0",
                    model=MODEL,
                    conversation_key="ghost",
                    ttl=duration_pb2.Duration(seconds=600),
                ),
                timeout=5,
            )
        plane = stack.d_connector().plane
        took = await eventually(lambda: ghost.lease.lease_id not in manager.table.leases, "the ghost lease revoked")
        print(f"a lease D does not hold revoked after {took:.1f} s")
        assert plane.revoked_unheld == 1
        assert own in manager.table.leases
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
        _, verdict = await stack.turn(msgs, "c1")
        assert verdict.startswith("hit"), verdict
    finally:
        await stack.stop_services()
        await stack.stop_engines()
