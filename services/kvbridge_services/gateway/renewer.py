"""Per-turn conversation lease renewals over one long-lived KeepAlive stream.

Every turn of a keyed conversation renews the conversation's lease so that D's retained
KV outlives the turn (prefill may be pulling it right now). Opening a KeepAlive stream per
turn cost about a millisecond of the turn's critical path on both ends (stream set-up,
write, read, cancel); here a turn only drops its conversation into a set, and one
background task writes whatever is pending as one request on a stream it keeps open.

The write waits for the turn's end (``flush_soon``, once the client has its answer), or at
most ``max_delay_s`` for a long turn: written mid-turn it competed with the prefill for the
CPU and the control plane (~0.4 ms of the turn at one conversation on the 2-core dev host).
The delay is safe because D frees an ended lease's blocks only after its free grace (10 s).
Renewals stay best effort, as before: a lost renewal is covered by the lease TTL and the
next turn's renewal, never by failing a turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc

from kvbridge.lease.v1 import lease_pb2

from ..common.tasks import cancel_and_wait, wait_at_most
from .control import ControlPlane

log = logging.getLogger(__name__)

ConversationRef = tuple[str, str, str]  # (tenant, model, conversation key)

MAX_PENDING = 10_000  # conversations waiting for the next write; the oldest are dropped beyond it
MAX_PER_REQUEST = 256
STREAM_LIFETIME_S = 300.0  # the stream's own deadline; it is reopened after
MAX_DELAY_S = 0.5  # a touched conversation is written at the latest this long after its touch
_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class ConversationRenewer:
    def __init__(
        self,
        control: ControlPlane,
        *,
        max_pending: int = MAX_PENDING,
        stream_lifetime_s: float = STREAM_LIFETIME_S,
        max_delay_s: float = MAX_DELAY_S,
    ) -> None:
        self._control = control
        self._max_pending = max_pending
        self._lifetime_s = stream_lifetime_s
        self._max_delay_s = max_delay_s
        self._wake_timer: asyncio.TimerHandle | None = None
        self._pending: OrderedDict[ConversationRef, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._unanswered = 0  # requests written whose response has not arrived yet
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.sent = 0
        self.streams_opened = 0

    def touch(self, tenant: str, model: str, conversation_key: str) -> None:
        """Renew this conversation's lease soon; never blocks the caller."""
        ref = (tenant, model, conversation_key)
        self._pending[ref] = None
        self._pending.move_to_end(ref)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self.dropped += 1
        self._idle.clear()
        if self._wake_timer is None and not self._wake.is_set():
            self._wake_timer = asyncio.get_running_loop().call_later(self._max_delay_s, self.flush_soon)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvbridge-conversation-renewer")

    def flush_soon(self) -> None:
        """Write what is pending now (a turn ended), without waiting for ``max_delay_s``."""
        if self._wake_timer is not None:
            self._wake_timer.cancel()
            self._wake_timer = None
        if self._pending:
            self._wake.set()

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Waits until everything touched so far was written and answered (tests, shutdown)."""
        self.flush_soon()
        await wait_at_most(self._idle.wait(), timeout_s)

    async def stop(self) -> None:
        if self._wake_timer is not None:
            self._wake_timer.cancel()
            self._wake_timer = None
        await cancel_and_wait(self._task)
        self._task = None

    def _check_idle(self) -> None:
        if not self._pending and self._unanswered == 0:
            self._idle.set()

    async def _run(self) -> None:
        failures = 0
        while self._pending:
            try:
                await self._stream_once()
                failures = 0
            except (grpc.RpcError, ConnectionError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: a write raced the stream's end (the reader holds the real cause).
                self._control.lease_stream_failed(exc)  # NOT_LEADER: the next stream goes to the leader
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.debug("conversation renewal stream failed (retry in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)
            finally:
                self._unanswered = 0
                self._check_idle()

    async def _stream_once(self) -> None:
        call = self._control.open_keep_alive(timeout_s=self._lifetime_s)
        self.streams_opened += 1
        reader = asyncio.create_task(self._read(call))
        try:
            while not reader.done():
                if not self._pending or not self._wake.is_set():
                    waiter = asyncio.create_task(self._wake.wait())
                    await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                batch = [self._pending.popitem(last=False)[0] for _ in range(min(len(self._pending), MAX_PER_REQUEST))]
                if not self._pending:
                    self._wake.clear()  # the next touch starts a new wait
                refs = [lease_pb2.ConversationRef(tenant=t, model=m, conversation_key=k) for t, m, k in batch]
                self._unanswered += 1
                await call.write(lease_pb2.KeepAliveRequest(conversations=refs))
                self.sent += len(refs)
            await reader  # raises what ended the stream
        finally:
            reader.cancel()
            call.cancel()

    async def _read(
        self, call: grpc.aio.StreamStreamCall[lease_pb2.KeepAliveRequest, lease_pb2.KeepAliveResponse]
    ) -> None:
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                raise ConnectionError("KeepAlive stream closed by the lease manager")
            self._unanswered = max(0, self._unanswered - 1)
            self._check_idle()
