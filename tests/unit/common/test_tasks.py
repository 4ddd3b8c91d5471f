"""kvbridge_services.common.tasks: cancel-and-wait and the bounded wait."""

from __future__ import annotations

import asyncio
import os
import signal

from kvbridge_services.common.tasks import cancel_and_wait, ended_before, stop_on_signals, wait_at_most


async def test_cancel_and_wait_ends_the_task_without_raising() -> None:
    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    task = asyncio.create_task(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and ended.is_set()
    await cancel_and_wait(task)  # an ended task, and no task, are fine
    await cancel_and_wait(None)


async def test_wait_at_most_returns_when_done_or_at_the_timeout() -> None:
    done = asyncio.Event()
    done.set()
    await wait_at_most(done.wait(), 5.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await wait_at_most(asyncio.Event().wait(), 0.05)
    assert 0.04 <= loop.time() - started < 2.0


async def test_ended_before_a_stop_returns_true_and_leaves_the_task_alone() -> None:
    task = asyncio.create_task(asyncio.sleep(0, result="done"))
    told: list[str] = []
    assert await ended_before(task, asyncio.Event(), lambda: told.append("stop"))
    assert task.result() == "done" and told == []


async def test_a_stop_first_cancels_the_task_and_waits_for_its_cleanup() -> None:
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.set()

    stop = asyncio.Event()
    task = asyncio.create_task(work())
    told: list[str] = []
    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert not await ended_before(task, stop, lambda: told.append("stop"))
    assert task.cancelled() and cleaned.is_set() and told == ["stop"]


async def test_stop_on_signals_sets_its_event_on_sigterm_and_removes_the_handler() -> None:
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler, None)
