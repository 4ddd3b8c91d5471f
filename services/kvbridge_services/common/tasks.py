"""Background tasks' ends, the same way everywhere: cancel and wait, or wait a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels ``task`` (None: nothing to do) and waits until it has ended; its cancellation is not raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs; the handlers go with the block."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def ended_before(
    task: asyncio.Task[Any], stop: asyncio.Event, on_stop: Callable[[], None] = lambda: None
) -> bool:
    """Waits for ``task`` or ``stop``: True when the task ended first; else ``on_stop()``, and the task is
    cancelled and waited for."""
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        return True
    on_stop()
    await cancel_and_wait(task)
    return False


async def wait_at_most(awaitable: Awaitable[Any], timeout_s: float) -> None:
    """Waits for ``awaitable`` at most ``timeout_s`` (it is cancelled then); a timeout is not an error."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await awaitable
