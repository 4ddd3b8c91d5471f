"""Post-turn work (compatibility-mode registrations) run as supervised background tasks: bounded, drained on
shutdown, and waitable per conversation so that closing a conversation right after a turn also releases what
that turn is still registering."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from .turn import ConversationId

log = logging.getLogger(__name__)


MAX_PENDING = 10_000  # cap of pending post-turn tasks (work beyond it is skipped)


class PostTurnWork:
    def __init__(self, *, max_pending: int = MAX_PENDING) -> None:
        self._max = max_pending
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_conversation: dict[ConversationId, set[asyncio.Task[None]]] = {}
        self.skipped = 0  # work not started for the cap

    def spawn(self, coro: Coroutine[Any, Any, None], conversation: ConversationId) -> None:
        """Starts ``coro``, or closes it unstarted when too much work is pending already."""
        if len(self._tasks) >= self._max:
            coro.close()
            self.skipped += 1
            log.warning("too much post-turn work pending; skipping one task")
            return
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._by_conversation.setdefault(conversation, set()).add(task)
        task.add_done_callback(lambda t: self._forget(conversation, t))

    def _forget(self, conversation: ConversationId, task: asyncio.Task[None]) -> None:
        tasks = self._by_conversation.get(conversation)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._by_conversation[conversation]

    def pending(self, conversation: ConversationId | None = None) -> int:
        if conversation is None:
            return len(self._tasks)
        return len(self._by_conversation.get(conversation, ()))

    async def settle(self, conversation: ConversationId, *, timeout_s: float) -> None:
        """Waits (bounded) for this conversation's pending work."""
        tasks = list(self._by_conversation.get(conversation, ()))
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def drain(self) -> None:
        """Waits for all pending work, including work started meanwhile."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
