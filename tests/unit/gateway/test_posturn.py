"""Post-turn work (gateway/posturn.py): bounded, drained, and waitable per conversation."""

from __future__ import annotations

import asyncio

from kvbridge_services.gateway.posturn import PostTurnWork

A = ("t", "m", "a")
B = ("t", "m", "b")


async def test_settling_a_conversation_waits_for_its_work_only() -> None:
    work = PostTurnWork()
    a_done, release_b = asyncio.Event(), asyncio.Event()

    async def a() -> None:
        await asyncio.sleep(0.01)
        a_done.set()

    async def b() -> None:
        await release_b.wait()

    work.spawn(a(), A)
    work.spawn(b(), B)
    assert work.pending(A) == 1 and work.pending(B) == 1 and work.pending() == 2
    await work.settle(A, timeout_s=5.0)
    assert a_done.is_set() and work.pending(A) == 0 and work.pending(B) == 1
    await work.settle(B, timeout_s=0.01)  # bounded: returns with B still pending
    assert work.pending(B) == 1
    release_b.set()
    await work.drain()
    assert work.pending() == 0


async def test_work_past_the_cap_is_skipped_not_queued() -> None:
    work = PostTurnWork(max_pending=1)
    gate = asyncio.Event()
    ran: list[str] = []

    async def job(name: str) -> None:
        await gate.wait()
        ran.append(name)

    work.spawn(job("first"), A)
    work.spawn(job("second"), A)  # closed unstarted: no "never awaited" warning, no task
    assert work.pending() == 1 and work.skipped == 1
    gate.set()
    await work.drain()
    assert ran == ["first"]


async def test_drain_also_waits_for_work_started_while_draining() -> None:
    work = PostTurnWork()
    ran: list[str] = []

    async def second() -> None:
        ran.append("second")

    async def first() -> None:
        await asyncio.sleep(0)
        work.spawn(second(), A)
        ran.append("first")

    work.spawn(first(), A)
    await work.drain()
    assert ran == ["first", "second"]
