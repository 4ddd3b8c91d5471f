"""Leader election through the store.

The leader key holds the leader's gRPC address and is attached to a short
store lease that the leader refreshes; a crashed leader's key vanishes when
that lease expires, and standbys, watching the key, campaign at once. The
store lease id doubles as the fencing token every leader write compares.

A store out of space (etcd's NOSPACE alarm) refuses the grant and the put a
campaign needs, but not the leader's refreshes (keep-alives are not writes):
the leader keeps leading through it, a standby stays a standby (logged once)
and campaigns again once writes are taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from kvbridge_services.common.store.base import (
    Compare,
    CompareTarget,
    EventType,
    Get,
    LeaseNotFound,
    Put,
    Store,
    StoreError,
    StoreNoSpace,
)

log = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None]]
_RETRY_S = 0.05  # pause before retrying a failed leader-key refresh


class LeaderElection:
    def __init__(
        self,
        store: Store,
        key: bytes,
        address: str,
        *,
        ttl_s: int,
        refresh_s: float,
        timeout_s: float,
        on_elected: Callback,
        on_deposed: Callback,
    ) -> None:
        self._store = store
        self._key = key
        self.address = address
        self._ttl = ttl_s
        self._refresh = refresh_s
        self._timeout = timeout_s
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._store_lease = 0
        self._vacancy_after = 0
        self._deposed = asyncio.Event()
        self.is_leader = False
        # Address of the current leader as last seen (ours when leading), None if unknown.
        self.leader_address: str | None = None

    def fence(self) -> Sequence[Compare]:
        """Compares that hold only while we still own the leader key."""
        return [Compare(self._key, CompareTarget.LEASE, "==", self._store_lease)]

    def lost(self) -> None:
        """A fenced write failed: step down without waiting for the next refresh."""
        self._deposed.set()

    async def run(self) -> None:
        """Campaign, lead, fall back to standby; forever (cancel to stop)."""
        refused = False  # the last campaign failed for lack of store space (logged once per episode)
        while True:
            try:
                won = await self._campaign()
                refused = False
                if won:
                    await self._lead()
                else:
                    await self._wait_for_vacancy()
            except asyncio.CancelledError:
                raise
            except StoreNoSpace as exc:
                if not refused:
                    log.warning("leader election: cannot campaign while the store refuses writes (%s)", exc)
                refused = True
                await asyncio.sleep(self._refresh)
            except (StoreError, TimeoutError) as exc:
                log.warning("leader election: store error %s; retrying", exc)
                await asyncio.sleep(self._refresh)

    async def _campaign(self) -> bool:
        lease = await self._store.grant_lease(self._ttl, timeout=self._timeout)
        result = await self._store.txn(
            [Compare.absent(self._key)],
            [Put(self._key, self.address.encode(), lease=lease)],
            [Get(self._key)],
            timeout=self._timeout,
        )
        if result.succeeded:
            self._store_lease = lease
            return True
        with contextlib.suppress(StoreError):
            await self._store.revoke_lease(lease, timeout=self._timeout)
        current = result.gets[0] if result.gets else None
        self.leader_address = current.value.decode(errors="replace") if current is not None else None
        self._vacancy_after = result.revision
        return False

    async def _lead(self) -> None:
        self._deposed.clear()
        self.is_leader = True
        self.leader_address = self.address
        log.info("elected lease-manager leader (%s)", self.address)
        refresher = asyncio.create_task(self._keep_refreshing())
        try:
            await self._on_elected()
            await self._deposed.wait()
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            self.is_leader = False
            self.leader_address = None
            log.warning("no longer the lease-manager leader")
            await self._on_deposed()
            # Free the key at once (if still ours) rather than making the next leader wait out its TTL.
            with contextlib.suppress(StoreError, TimeoutError):
                await self._store.revoke_lease(self._store_lease, timeout=self._timeout)

    async def _keep_refreshing(self) -> None:
        last_ok = time.monotonic()
        # Step down before the store could let a standby in: the key may lapse ttl after the last refresh.
        # Each attempt may use all the time left until then (a loaded store answers late, not never).
        # (Writes are fenced anyway; this bounds how long a stale leader may still acknowledge renewals.)
        give_up_after = self._ttl - 0.1
        pause = self._refresh
        while not self._deposed.is_set():
            await asyncio.sleep(pause)
            pause = _RETRY_S  # until the next success
            left = give_up_after - (time.monotonic() - last_ok)
            if left <= 0:
                log.warning("leader key not refreshed for %.1fs; stepping down", time.monotonic() - last_ok)
                self._deposed.set()
                return
            sent = time.monotonic()
            try:
                await self._store.refresh_lease(self._store_lease, timeout=left)
                last_ok, pause = sent, self._refresh
            except LeaseNotFound:
                self._deposed.set()
            except (StoreError, TimeoutError) as exc:
                log.warning("leader key refresh failed (%s); %.1fs left", exc, left)

    async def _wait_for_vacancy(self) -> None:
        """Until the leader key is deleted (or a recheck interval passes)."""
        recheck_s = max(self._ttl * 2.0, 2.0)
        watch = self._store.watch_prefix(self._key, start_revision=self._vacancy_after + 1)
        try:
            async with asyncio.timeout(recheck_s):
                async for batch in watch:
                    for event in batch.events:
                        if event.kv.key != self._key:
                            continue
                        if event.type == EventType.DELETE:
                            self.leader_address = None
                            return
                        self.leader_address = event.kv.value.decode(errors="replace")
        except TimeoutError:
            return
        finally:
            await watch.aclose()  # type: ignore[attr-defined]

    async def resign(self) -> None:
        """Give up leadership now (graceful shutdown): the standby need not wait for the TTL."""
        if self.is_leader and self._store_lease:
            with contextlib.suppress(StoreError, TimeoutError):
                await self._store.revoke_lease(self._store_lease, timeout=self._timeout)
        self._deposed.set()
