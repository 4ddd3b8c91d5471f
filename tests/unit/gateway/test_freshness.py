"""Read your own turn (gateway/freshness.py, EntryMirror.wait_for_epoch): a lookup right after a turn waits,
bounded, for that turn's registration; a later one never waits."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.registry.v1 import registry_pb2
from kvbridge_services.gateway.freshness import FinishedTurn, RecentTurns, registration_wait_s
from kvbridge_services.gateway.mirror import EntryMirror

CONV = ("acme", "m", "c1")


def test_a_lookup_waits_only_for_a_recent_turn_not_registered_yet() -> None:
    last = FinishedTurn(epoch=100, ended_at=10.0)
    assert registration_wait_s(last, registered_epoch=None, now=10.1, max_wait_s=0.5) == pytest.approx(0.4)
    assert registration_wait_s(last, registered_epoch=99, now=10.0, max_wait_s=0.5) == pytest.approx(0.5)
    assert registration_wait_s(last, registered_epoch=100, now=10.0, max_wait_s=0.5) == 0.0  # registered
    assert registration_wait_s(last, registered_epoch=101, now=10.0, max_wait_s=0.5) == 0.0  # a newer one too
    assert registration_wait_s(last, registered_epoch=None, now=10.6, max_wait_s=0.5) == 0.0  # came later
    assert registration_wait_s(None, registered_epoch=None, now=10.0, max_wait_s=0.5) == 0.0
    assert registration_wait_s(last, registered_epoch=None, now=10.0, max_wait_s=0.0) == 0.0  # off


def test_recent_turns_keep_the_last_turn_per_conversation_bounded() -> None:
    clock = iter([1.0, 2.0, 3.0, 4.0])
    recent = RecentTurns(max_conversations=2, clock=lambda: next(clock))
    recent.finished(CONV, 5)
    recent.finished(CONV, 7)
    assert recent.last(CONV) == FinishedTurn(7, 2.0)
    recent.finished(("acme", "m", "c2"), 1)
    recent.finished(("acme", "m", "c3"), 1)
    assert recent.last(CONV) is None  # least recently used went first


def _put(mirror: EntryMirror, epoch: int, revision: int) -> None:
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant=CONV[0], model=CONV[1], conversation_key=CONV[2]),
        engine_id="d0",
        block_size=16,
        token_count=32,
        block_hashes=[b"\x01" * 16, b"\x02" * 16],
        final_block_hash=b"\x02" * 16,
        epoch=epoch,
    )
    message = registry_pb2.WatchEntriesResponse(revision=revision)
    message.events.add(type=registry_pb2.EntryEvent.TYPE_PUT, entry=entry, revision=revision)
    mirror.apply(message)


async def test_the_mirror_wakes_a_waiting_lookup_when_the_epoch_arrives() -> None:
    mirror = EntryMirror(max_entries=10, stale_after_s=3.0)
    waiting = asyncio.create_task(mirror.wait_for_epoch(CONV, 200, timeout_s=5.0))
    await asyncio.sleep(0.01)
    _put(mirror, epoch=150, revision=1)  # the turn before: not enough
    await asyncio.sleep(0.01)
    assert not waiting.done()
    _put(mirror, epoch=200, revision=2)
    assert await asyncio.wait_for(waiting, 1.0) is True
    assert mirror.epoch_of(*CONV) == 200
    assert await mirror.wait_for_epoch(CONV, 200, timeout_s=0.0) is True  # already there: no wait


async def test_a_registration_that_never_comes_costs_at_most_the_bound() -> None:
    mirror = EntryMirror(max_entries=10, stale_after_s=3.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await mirror.wait_for_epoch(CONV, 1, timeout_s=0.05) is False
    assert 0.04 <= loop.time() - started < 1.0
    assert mirror._waiters == {} and mirror._waiting == 0  # nothing left behind
