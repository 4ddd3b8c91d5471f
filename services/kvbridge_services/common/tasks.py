"""Background tasks' ends, the same way everywhere: cancel and wait, or wait a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels ``task`` (None: nothing to do) and waits until it has ended; its cancellation is not raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def wait_at_most(awaitable: Awaitable[Any], timeout_s: float) -> None:
    """Waits for ``awaitable`` at most ``timeout_s`` (it is cancelled then); a timeout is not an error."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await awaitable
