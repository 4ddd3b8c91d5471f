"""Async client of kvbridge.lease.v1.LeaseService, and a shared heartbeater."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import duration_pb2

from kvbridge.backoff import Backoff
from kvbridge.errors import DeadlineExceeded, KvbridgeError, Reason, Unavailable, from_rpc_error, reason_name
from kvbridge.lease.v1 import lease_pb2 as pb
from kvbridge.lease.v1 import lease_pb2_grpc as pb_grpc
from kvbridge.types.v1 import types_pb2

from .channel import BaseClient, backoff_delays

log = logging.getLogger(__name__)

# Ids per KeepAlive message the heartbeater sends (servers cap this).
KEEPALIVE_BATCH = 1000
# Floor of the renewal interval however short the leases' TTL.
MIN_INTERVAL_S = 0.05
# Pauses before re-opening a broken KeepAlive stream: doubling from the first to the last.
_RECONNECT_FIRST_S = 0.1
_RECONNECT_MAX_S = 5.0


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class LeaseClient(BaseClient):
    """The one lease-manager client: the SDK's, the gateway's, the connector's and the registry's. Unary calls
    and ``renew_once`` retry UNAVAILABLE and follow NOT_LEADER to the leader (``BaseClient``); a caller that
    keeps its own stream on ``stub`` reports how it ended with ``note_failure``, which moves the client the
    same way."""

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._lease = pb_grpc.LeaseServiceStub(channel)

    def _stub(self) -> Any:
        return self._lease

    @property
    def stub(self) -> pb_grpc.LeaseServiceAsyncStub:
        """The stub of the current target (the leader after a redirect): look it up per call or stream."""
        return self._lease

    def note_failure(self, exc: BaseException, tried: str | None = None) -> None:
        """A call or stream on ``stub`` to ``tried`` (default: the current target) failed with ``exc``: follow
        the leader a NOT_LEADER names, or fall back to the configured target from a redirected address that
        gave no answer. Anything else is left to the caller."""
        if isinstance(exc, grpc.RpcError):
            err: KvbridgeError = from_rpc_error(exc)
        elif isinstance(exc, KvbridgeError):
            err = exc
        elif isinstance(exc, TimeoutError):
            err = DeadlineExceeded("", "no answer within the deadline")
        else:
            return
        self._follow(err, self.target if tried is None else tried, set())

    async def grant(
        self,
        *,
        kind: int,
        tenant: str = "",
        engine_id: str = "",
        model: str = "",
        conversation_key: str = "",
        retained_tokens: int = 0,
        ttl_s: float | None = None,
        request_id: str = "",
    ) -> pb.GrantLeaseResponse:
        req = pb.GrantLeaseRequest(
            kind=kind,  # type: ignore[arg-type]
            tenant=tenant,
            engine_id=engine_id,
            model=model,
            conversation_key=conversation_key,
            retained_tokens=retained_tokens,
            request_id=request_id,
        )
        if ttl_s is not None:
            req.ttl.CopyFrom(_duration(ttl_s))
        resp: pb.GrantLeaseResponse = await self._unary("GrantLease", req)
        return resp

    async def revoke(self, lease_id: int, reason: int = types_pb2.REVOKE_REASON_CLIENT_CLOSED) -> pb.Lease:
        req = pb.RevokeLeaseRequest(lease_id=lease_id, reason=reason)  # type: ignore[arg-type]
        resp: pb.RevokeLeaseResponse = await self._unary("RevokeLease", req)
        return resp.lease

    async def get(self, lease_id: int) -> pb.Lease:
        resp: pb.GetLeaseResponse = await self._unary("GetLease", pb.GetLeaseRequest(lease_id=lease_id))
        return resp.lease

    async def list_leases(
        self, tenant: str = "", engine_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> pb.ListLeasesResponse:
        req = pb.ListLeasesRequest(tenant=tenant, engine_id=engine_id, page_size=page_size, page_token=page_token)
        resp: pb.ListLeasesResponse = await self._unary("ListLeases", req)
        return resp

    async def renew_once(
        self, lease_ids: list[int], conversations: list[pb.ConversationRef] | None = None
    ) -> list[pb.LeaseStatus]:
        """One KeepAlive round trip on a short-lived stream (for occasional renewals). Retried (a renewal is
        idempotent) like a unary call: UNAVAILABLE with backoff, following NOT_LEADER."""
        req = pb.KeepAliveRequest(lease_ids=lease_ids, conversations=conversations or [])
        delays = backoff_delays(self.options)
        unreachable: set[str] = set()
        while True:
            tried = self.target
            # The request as an iterable, not call.write(): a write racing the stream's end raises
            # InvalidStateError and hides the status; this way every failure is the RpcError.
            call = self._lease.KeepAlive(iter([req]), metadata=self.options.metadata(), timeout=self.options.timeout_s)
            try:
                resp = await call.read()
            except grpc.RpcError as exc:
                await self._before_retry(from_rpc_error(exc), delays, tried, unreachable)
                continue
            finally:
                call.cancel()
            if not isinstance(resp, pb.KeepAliveResponse):
                return []
            return list(resp.statuses)

    def watch(self, engine_id: str) -> AsyncIterator[pb.WatchLeasesResponse]:
        """The WatchLeases stream of an engine (caller handles reconnects)."""
        call = self._lease.WatchLeases(pb.WatchLeasesRequest(engine_id=engine_id), metadata=self.options.metadata())
        return call.__aiter__()


class Heartbeater:
    """Keeps many leases alive over ONE KeepAlive stream.

    Add lease ids (or conversations, for SDK users who know only those); every
    ``interval_s`` (or a third of the shortest TTL the server reports, if less)
    the heartbeater renews them all in batches. A lease id the server reports
    gone is dropped and reported to ``on_lost``. A conversation stays registered
    until removed: it may have no lease yet (before its first turn finished) or
    get a new one with its next turn; ``on_lost`` hears when a lease it had ends.
    A conversation the server refuses (``LeaseStatus.error``: malformed, or another
    tenant's) is dropped and reported to ``on_lost``; the stream and every other
    lease on it carry on.
    A broken stream is re-opened with backoff; nothing waits forever. It reconnects to the leader a
    NOT_LEADER names, and back to the client's configured target when that leader stops answering
    (the stream shares the client's channel and redirect state).
    """

    def __init__(
        self,
        client: LeaseClient,
        *,
        interval_s: float = 5.0,
        on_lost: Callable[[pb.LeaseStatus], None] | None = None,
    ) -> None:
        self._client = client
        self._interval_s = interval_s
        self._on_lost = on_lost
        self._lease_ids: set[int] = set()
        self._conversations: dict[tuple[str, str, str], pb.ConversationRef] = {}
        self._alive_conversations: set[tuple[str, str, str]] = set()
        self._shortest_ttl_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.rounds = 0
        # KeepAlive streams opened so far (1 unless the stream broke and was re-opened).
        self.streams_opened = 0

    @property
    def running(self) -> bool:
        return self._task is not None

    @property
    def interval_s(self) -> float:
        """The pause between renewal rounds now."""
        if self._shortest_ttl_s is None:
            return self._interval_s
        return max(min(self._interval_s, self._shortest_ttl_s / 3), MIN_INTERVAL_S)

    def add_lease(self, lease_id: int) -> None:
        self._lease_ids.add(lease_id)

    def remove_lease(self, lease_id: int) -> None:
        self._lease_ids.discard(lease_id)

    def add_conversation(self, tenant: str, model: str, conversation_key: str) -> None:
        ref = pb.ConversationRef(tenant=tenant, model=model, conversation_key=conversation_key)
        self._conversations[(tenant, model, conversation_key)] = ref

    def remove_conversation(self, tenant: str, model: str, conversation_key: str) -> None:
        self._conversations.pop((tenant, model, conversation_key), None)
        self._alive_conversations.discard((tenant, model, conversation_key))

    def renew_now(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvbridge-heartbeater")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _batches(self) -> list[pb.KeepAliveRequest]:
        ids = sorted(self._lease_ids)
        convs = list(self._conversations.values())
        out = [pb.KeepAliveRequest(lease_ids=ids[i : i + KEEPALIVE_BATCH]) for i in range(0, len(ids), KEEPALIVE_BATCH)]
        out += [
            pb.KeepAliveRequest(conversations=convs[i : i + KEEPALIVE_BATCH])
            for i in range(0, len(convs), KEEPALIVE_BATCH)
        ]
        return out

    async def _run(self) -> None:
        backoff = Backoff(_RECONNECT_FIRST_S, _RECONNECT_MAX_S)
        # Redirected addresses that gave no answer since the stream last worked (see BaseClient._follow).
        unreachable: set[str] = set()
        while True:
            rounds = self.rounds
            tried = self._client.target
            try:
                await self._stream_once()
                failure: Exception | None = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep heartbeating through outages
                failure = exc
            if self.rounds > rounds:  # the stream worked: whatever ended it is a fresh outage
                backoff.reset()
                unreachable.clear()
            if isinstance(failure, TimeoutError):  # a renewal went unanswered: as good as a dead address
                failure = DeadlineExceeded("", "no KeepAlive response within the deadline")
            if isinstance(failure, KvbridgeError) and failure.reason == Reason.STREAM_IDLE.value:
                # The server closed a stream that had nothing to renew for its idle limit: not an outage.
                log.debug("lease keep-alive stream to %s closed while idle; reopening", tried)
                failure = None
                backoff.reset()
            if isinstance(failure, KvbridgeError):
                # Reconnects to the leader a NOT_LEADER names, or falls back from a dead redirected one.
                self._client._follow(failure, tried, unreachable)
            delay = backoff.next_delay()
            if failure is not None:
                log.warning(
                    "lease keep-alive stream to %s failed (%s); retrying in %.1fs via %s",
                    tried,
                    failure,
                    delay,
                    self._client.target,
                )
            await asyncio.sleep(delay)

    async def _stream_once(self) -> None:
        call = self._client._lease.KeepAlive(metadata=self._client.options.metadata())
        self.streams_opened += 1
        try:
            while True:
                for req in self._batches():
                    try:
                        await call.write(req)
                    except asyncio.InvalidStateError:
                        # The stream ended under the write: reading it raises its status (the real cause).
                        await call.read()
                        return
                    resp = await asyncio.wait_for(call.read(), self._client.options.timeout_s)
                    if not isinstance(resp, pb.KeepAliveResponse):
                        return  # EOF: the server ended the stream
                    self._handle(resp)
                self.rounds += 1
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        except asyncio.CancelledError:
            # The client closed the channel under the stream (it moved to another address): reconnect.
            # A cancel of this task itself is still pending on it and propagates.
            task = asyncio.current_task()
            if call.cancelled() and task is not None and task.cancelling() == 0:
                raise Unavailable("", "the KeepAlive stream's channel was closed") from None
            raise
        finally:
            call.cancel()

    def _handle(self, resp: pb.KeepAliveResponse) -> None:
        for status in resp.statuses:
            if status.alive:
                ttl_s = status.ttl.ToNanoseconds() / 1e9
                if ttl_s > 0 and (self._shortest_ttl_s is None or ttl_s < self._shortest_ttl_s):
                    self._shortest_ttl_s = ttl_s
            if status.HasField("conversation"):
                c = status.conversation
                key = (c.tenant, c.model, c.conversation_key)
                if key not in self._conversations:
                    # The server reports the tenant it resolved; a ref sent with tenant "" is filed under "".
                    key = ("", c.model, c.conversation_key)
                if status.error:
                    # Refused (malformed, or another tenant's): it will never renew, so stop sending it.
                    log.warning(
                        "lease keep-alive refused conversation %r: %s", c.conversation_key, reason_name(status.error)
                    )
                    self.remove_conversation(*key)
                    if self._on_lost is not None:
                        self._on_lost(status)
                    continue
                if status.alive:
                    if key in self._conversations:
                        self._alive_conversations.add(key)
                    continue
                if key not in self._alive_conversations:
                    continue  # no lease yet (or still none): nothing was lost
                self._alive_conversations.discard(key)
            elif status.alive:
                continue
            else:
                self._lease_ids.discard(status.lease_id)
            if self._on_lost is not None:
                self._on_lost(status)
