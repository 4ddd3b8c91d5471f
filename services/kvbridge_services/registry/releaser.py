"""Releasing the blocks of superseded / evicted entries: revoke their lease at the lease manager.

Registration never fails because a revoke failed: revokes go to a bounded
queue and a background worker retries them with backoff (an unrevoked lease
still ends at its deadline, so a dropped revoke only delays the release).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc

from kvbridge.backoff import Backoff
from kvbridge.errors import KvbridgeError
from kvbridge.sdk.channel import ClientOptions
from kvbridge.sdk.lease import LeaseClient
from kvbridge.types.v1 import types_pb2

from ..common.channels import peer_channel
from ..common.config import PeerTlsSettings
from ..common.tasks import cancel_and_wait, wait_at_most

log = logging.getLogger(__name__)

_MAX_DELAY_S = 10.0


class LeaseReleaser(Protocol):
    async def revoke(self, lease_id: int, reason: types_pb2.RevokeReason.ValueType) -> None: ...


class LogOnlyReleaser:
    """No lease manager configured: leases end at their deadline; say so."""

    async def revoke(self, lease_id: int, reason: types_pb2.RevokeReason.ValueType) -> None:
        log.info(
            "no lease service configured; lease %d (%s) ends at its deadline",
            lease_id,
            types_pb2.RevokeReason.Name(reason),
        )


class GrpcLeaseReleaser:
    """Revokes through kvbridge.lease.v1.LeaseService, with the SDK's lease client (follows NOT_LEADER)."""

    def __init__(
        self, target: str, *, api_key: str = "", timeout_s: float = 2.0, tls: PeerTlsSettings | None = None
    ) -> None:
        # One attempt more than none, for a NOT_LEADER redirect; BackgroundRevoker retries the rest.
        self._client = LeaseClient(
            target,
            ClientOptions(api_key=api_key or None, timeout_s=timeout_s, max_attempts=2),
            channel_factory=lambda t: peer_channel(t, tls),
        )

    async def revoke(self, lease_id: int, reason: types_pb2.RevokeReason.ValueType) -> None:
        try:
            await self._client.revoke(lease_id, reason)
        except KvbridgeError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:  # already gone: nothing to release
                return
            raise

    async def close(self) -> None:
        await self._client.close()


class BackgroundRevoker:
    """A bounded queue of revokes, retried with exponential backoff."""

    def __init__(
        self, releaser: LeaseReleaser, *, max_queue: int = 10_000, max_attempts: int = 8, base_delay_s: float = 0.2
    ) -> None:
        self._releaser = releaser
        self._queue: asyncio.Queue[tuple[int, types_pb2.RevokeReason.ValueType]] = asyncio.Queue(max_queue)
        self._max_attempts = max_attempts
        self._base_delay_s = base_delay_s
        self._task: asyncio.Task[None] | None = None
        self.revoked: int = 0
        self.dropped: int = 0

    def submit(self, lease_id: int, reason: types_pb2.RevokeReason.ValueType) -> None:
        try:
            self._queue.put_nowait((lease_id, reason))
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("revoke queue full; lease %d left to expire at its deadline", lease_id)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="registry-revoker")

    async def _run(self) -> None:
        while True:
            lease_id, reason = await self._queue.get()
            try:
                await self._revoke_with_retries(lease_id, reason)
            finally:
                self._queue.task_done()

    async def _revoke_with_retries(self, lease_id: int, reason: types_pb2.RevokeReason.ValueType) -> None:
        # Not kvbridge.backoff.retry: a failed last attempt is followed by its pause too, which keeps a queue
        # of revokes from hammering a lease manager that is down.
        backoff = Backoff(self._base_delay_s, _MAX_DELAY_S)
        for _ in range(self._max_attempts):
            try:
                await self._releaser.revoke(lease_id, reason)
                self.revoked += 1
                return
            except Exception as exc:  # noqa: BLE001 - any failure is retried, then logged
                delay = backoff.next_delay()
                log.warning("revoking lease %d failed (%s); retry in %.1fs", lease_id, exc, delay)
                await asyncio.sleep(delay)
        self.dropped += 1
        log.error("gave up revoking lease %d; it ends at its deadline", lease_id)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until queued revokes are done (tests, shutdown)."""
        await wait_at_most(self._queue.join(), timeout_s)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
