"""kvbridge_services.common.tasks: cancel-and-wait and the bounded wait."""

from __future__ import annotations

import asyncio

from kvbridge_services.common.tasks import cancel_and_wait, wait_at_most


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
