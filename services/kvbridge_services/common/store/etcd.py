"""EtcdStore: the Store over etcd v3 (etcd3aio's generated stubs and services).

- One gRPC channel, round-robin over every endpoint: a dead member's
  subchannel drops out and calls retry on the others within the deadline.
- TLS or mutual TLS when given PEM material (``StoreSettings.etcd_tls()``); a
  handshake failure (wrong CA, refused client cert) is named as such.
- Every call has a deadline; past it, or on a transport failure that retries
  cannot fix in time, the caller gets ``StoreUnavailable``.
- Writes are retried only when etcd certainly did not apply them (the
  connection was never made, or there was no leader); otherwise the outcome
  is unknown and the caller gets ``StoreUnavailable`` at once.
- A write refused at etcd's space quota (the NOSPACE alarm) raises
  ``StoreNoSpace`` at once (no retry can help); the store then says so
  (``writes_refused``), logs it once per episode, and asks etcd's alarm list
  every second until the alarm is gone or a write succeeds (docs/etcd-space.md).
- Watches run on our own stream so reconnects resume exactly after the last
  delivered event (etcd3aio's own watch resumes from the header revision,
  which can be ahead of the events while a watcher catches up). They ask etcd
  to fragment a large revision (a lease expiry deleting thousands of keys, each
  delete carrying its previous value) and put the fragments back together: in
  one message it would pass gRPC's 4 MiB receive limit, and the watch would
  fail at that revision on every retry until etcd compacted it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError, prefix_range_end
from etcd3aio._protobuf import Compare as PbCompare
from etcd3aio._protobuf import (  # type: ignore[attr-defined]  # rpc_pb2 is not re-exported
    DeleteRangeRequest,
    LeaseKeepAliveRequest,
    LeaseStub,
    MaintenanceStub,
    PutRequest,
    RangeRequest,
    RequestOp,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
    rpc_pb2,
)
from etcd3aio.connections import ConnectionManager
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService

from kvbridge.backoff import Backoff

from ..config import EtcdTls
from .base import (
    DEFAULT_TIMEOUT_S,
    Compacted,
    Compare,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    RangeQuery,
    Store,
    StoreError,
    StoreNoSpace,
    StoreUnavailable,
    Txn,
    TxnResult,
    WatchBatch,
    WatchEvent,
    WatchQuery,
)

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# UNAVAILABLE details that prove the request was never applied (safe to retry a write).
_NOT_APPLIED_HINTS = ("failed to connect", "connection refused", "connections to all backends", "no leader")
_TLS_HINTS = ("handshake", "certificate", "ssl_error", "tls", "tsi_")  # tsi_: gRPC's TLS layer
_COMPARE_OPS = {"==": PbCompare.EQUAL, "!=": PbCompare.NOT_EQUAL, "<": PbCompare.LESS, ">": PbCompare.GREATER}
_COMPARE_FIELDS = {
    CompareTarget.VALUE: (PbCompare.VALUE, "value"),
    CompareTarget.VERSION: (PbCompare.VERSION, "version"),
    CompareTarget.CREATE: (PbCompare.CREATE, "create_revision"),
    CompareTarget.MOD: (PbCompare.MOD, "mod_revision"),
    CompareTarget.LEASE: (PbCompare.LEASE, "lease"),
}
# Ask etcd to cancel a watch when its member loses the leader (else it hangs silently).
_WATCH_METADATA = (("hasleader", "true"),)
_WATCH_QUEUE = 64
_MVCC_EVENT_DELETE = 1  # mvccpb.Event.EventType.DELETE
_RETRY_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
_MIN_ATTEMPT_S = 0.5
# etcd's answer to a write at its space quota (ErrGRPCNoSpace): RESOURCE_EXHAUSTED with this text.
_NO_SPACE_HINT = "database space exceeded"
NO_SPACE_REASON = "etcd NOSPACE alarm: its database reached --quota-backend-bytes; writes are refused"
_NO_SPACE_PROBE_S = 1.0  # how often the alarm list is asked while writes are refused


def _rpc_error(exc: BaseException) -> grpc.aio.AioRpcError | None:
    """The gRPC error behind an etcd3aio exception (or the exception itself)."""
    while exc is not None:
        if isinstance(exc, grpc.aio.AioRpcError):
            return exc
        exc = exc.__cause__  # type: ignore[assignment]
    return None


def _not_applied(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    if rpc is None or rpc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = (rpc.details() or "").lower()
    return any(hint in details for hint in _NOT_APPLIED_HINTS)


class EtcdTlsError(StoreUnavailable):
    """etcd refused the TLS handshake (wrong CA, missing or untrusted client certificate): configuration,
    not an outage, so services fail at start on it."""


def _tls_failure(exc: BaseException) -> bool:
    """The connection failed in the TLS handshake (wrong CA, no or rejected client certificate)."""
    rpc = _rpc_error(exc)
    details = ((rpc.details() or "") if rpc is not None else str(exc)).lower()
    return any(hint in details for hint in _TLS_HINTS)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, EtcdConnectionError | EtcdTransientError):
        return True
    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() in _TRANSIENT


def _kv(pb: Any) -> KeyValue:
    return KeyValue(pb.key, pb.value, pb.create_revision, pb.mod_revision, pb.version, pb.lease)


def _range_start(prefix: bytes, start_after: bytes | None) -> bytes:
    if start_after is not None and start_after >= prefix:
        return start_after + b"\x00"  # the smallest key after start_after
    return prefix or b"\x00"  # etcd rejects an empty key


def _to_pb_compare(c: Compare) -> Any:
    target, field = _COMPARE_FIELDS[c.target]
    if isinstance(c.operand, bytes) != (c.target is CompareTarget.VALUE):
        raise TypeError(f"compare on {c.target.value} needs a {'bytes' if field == 'value' else 'int'} operand")
    return PbCompare(result=_COMPARE_OPS[c.op], target=target, key=c.key, **{field: c.operand})


def _to_pb_op(op: Op) -> Any:
    if isinstance(op, Put):
        return RequestOp(request_put=PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        end = prefix_range_end(op.key) if op.prefix else b""
        return RequestOp(request_delete_range=DeleteRangeRequest(key=op.key or b"\x00", range_end=end))
    return RequestOp(request_range=RangeRequest(key=op.key))


class EtcdStore(Store):
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        watch_unavailable_after_s: float = 30.0,
        tls: EtcdTls | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.default_timeout = timeout
        self._watch_unavailable_after_s = watch_unavailable_after_s
        self._manager = ConnectionManager(self.endpoints, keepalive_time_ms=5_000, keepalive_timeout_ms=3_000)
        self._tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._kv_svc: KVService | None = None
        self._lease_svc: LeaseService | None = None
        self._closed = False
        # Since when (monotonic) etcd has refused writes for NOSPACE, None while it takes them.
        self._no_space_since: float | None = None
        self._no_space_probe: asyncio.Task[None] | None = None
        self.no_space_episodes = 0

    # grpc.aio channels bind to the running loop, so they are made on first use.
    def _channel_now(self) -> grpc.aio.Channel:
        if self._closed:
            raise StoreUnavailable("store is closed")
        if self._channel is None:
            tls = self._tls
            self._channel = (
                self._manager.get_channel()
                if tls is None
                else self._manager.get_channel(ca_cert=tls.ca_pem, cert_key=tls.key_pem, cert_chain=tls.cert_pem)
            )
            # We retry ourselves, within the caller's deadline.
            self._kv_svc = KVService(self._channel, max_attempts=1)
            self._lease_svc = LeaseService(self._channel, max_attempts=1)
        return self._channel

    @property
    def _kvs(self) -> KVService:
        self._channel_now()
        assert self._kv_svc is not None
        return self._kv_svc

    @property
    def _leases(self) -> LeaseService:
        self._channel_now()
        assert self._lease_svc is not None
        return self._lease_svc

    async def _call(
        self, name: str, fn: Callable[[float], Awaitable[_T]], timeout: float, *, idempotent: bool = True
    ) -> _T:
        """Run ``fn(remaining_s)`` until it succeeds or the deadline passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        backoff = Backoff(_RETRY_BACKOFF_S, _MAX_BACKOFF_S)
        last: BaseException | None = None
        while (remaining := deadline - loop.time()) > 0:
            # A read may hang on a member that lost its leader: cap each try so a retry can reach
            # another member. A write gets the whole deadline (cutting it short leaves its outcome unknown).
            attempt_s = min(remaining, max(timeout / 3, _MIN_ATTEMPT_S)) if idempotent else remaining
            try:
                async with asyncio.timeout(attempt_s):
                    return await fn(attempt_s)
            except TimeoutError:
                if not idempotent:
                    break
                last = TimeoutError(f"attempt timed out after {attempt_s:.3g}s")
                continue
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                if not _is_transient(exc):
                    error = self._translate(name, exc)
                    if isinstance(error, StoreNoSpace):
                        self._refused_for_space(name)
                    raise error from exc
                if not idempotent and not _not_applied(exc):
                    raise StoreUnavailable(f"etcd {name}: outcome unknown ({exc})") from exc
                last = exc
            await backoff.sleep(deadline)
        if last is not None and _tls_failure(last):
            raise EtcdTlsError(
                f"etcd {name}: TLS handshake with etcd failed (check KVBRIDGE_ETCD_CA_FILE, "
                f"KVBRIDGE_ETCD_CERT_FILE, KVBRIDGE_ETCD_KEY_FILE): {last}"
            ) from last
        raise StoreUnavailable(f"etcd {name}: no answer within {timeout:.3g}s ({last or 'deadline'})") from last

    @staticmethod
    def _translate(name: str, exc: BaseException) -> StoreError:
        rpc = _rpc_error(exc)
        details = (rpc.details() or "") if rpc is not None else str(exc)
        if _NO_SPACE_HINT in details:
            return StoreNoSpace(f"etcd {name} refused: {details} (NOSPACE alarm; see docs/etcd-space.md)")
        if "lease not found" in details:
            return LeaseNotFound(details)
        if "compacted" in details:
            return Compacted(0)
        return StoreError(f"etcd {name} failed: {details}")

    # ------------------------------------------------------------------ reads

    async def get(self, key: bytes, *, timeout: float = DEFAULT_TIMEOUT_S) -> KeyValue | None:
        resp = await self._call("get", lambda t: self._kvs.get(key, timeout=t), timeout)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def read_range(self, query: RangeQuery, *, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[KeyValue], int]:
        start = _range_start(query.prefix, query.start_after)
        end = prefix_range_end(query.prefix) if query.prefix else b"\x00"
        resp = await self._call(
            "range",
            lambda t: self._kvs.get(start, end, limit=query.limit, keys_only=query.keys_only, timeout=t),
            timeout,
        )
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    async def current_revision(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        resp = await self._call("revision", lambda t: self._kvs.get(b"\x00", count_only=True, timeout=t), timeout)
        return int(resp.header.revision)

    # ----------------------------------------------------------------- writes

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        sent = time.monotonic()
        resp = await self._call(
            "put", lambda t: self._kvs.put(key, value, lease=lease, timeout=t), timeout, idempotent=False
        )
        self._wrote(sent)
        return int(resp.header.revision)

    async def delete(self, key: bytes, *, prefix: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        end = prefix_range_end(key) if prefix else None
        resp = await self._call(
            "delete", lambda t: self._kvs.delete(key or b"\x00", end, timeout=t), timeout, idempotent=False
        )
        return int(resp.deleted)

    async def apply_txn(self, txn: Txn, *, timeout: float = DEFAULT_TIMEOUT_S) -> TxnResult:
        pb_compares = [_to_pb_compare(c) for c in txn.compares]
        pb_success = [_to_pb_op(op) for op in txn.success]
        pb_failure = [_to_pb_op(op) for op in txn.failure]
        writes = any(not isinstance(op, Get) for op in (*txn.success, *txn.failure))
        sent = time.monotonic()
        resp = await self._call(
            "txn",
            lambda t: self._kvs.txn(pb_compares, pb_success, pb_failure, timeout=t),
            timeout,
            idempotent=not writes,
        )
        if any(isinstance(op, Put) for op in (*txn.success, *txn.failure)):
            self._wrote(sent)  # etcd refuses any txn holding a put at NOSPACE, whichever branch would run
        gets: list[KeyValue | None] = []
        for r in resp.responses:
            if r.WhichOneof("response") == "response_range":
                kvs = r.response_range.kvs
                gets.append(_kv(kvs[0]) if kvs else None)
        return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision), gets=gets)

    async def compact(self, revision: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Drop history before ``revision`` (etcd keeps no automatic compaction here)."""
        await self._call("compact", lambda t: self._kvs.compact(revision, physical=True, timeout=t), timeout)

    # ------------------------------------------------------------------ leases

    async def grant_lease(self, ttl_s: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        if ttl_s < 1:
            raise ValueError("lease TTL must be >= 1 second")
        # A lost grant only leaks a lease that expires by itself: safe to retry.
        sent = time.monotonic()
        resp = await self._call("grant", lambda t: self._leases.grant(ttl_s, timeout=t), timeout)
        if resp.error:
            raise StoreError(f"etcd lease grant failed: {resp.error}")
        self._wrote(sent)
        return int(resp.ID)

    async def refresh_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        async def once(remaining: float) -> int:
            async def requests() -> AsyncIterator[Any]:
                yield LeaseKeepAliveRequest(ID=lease_id)

            call = LeaseStub(self._channel_now()).LeaseKeepAlive(requests(), timeout=remaining)
            try:
                async for resp in call:
                    return int(resp.TTL)
            finally:
                call.cancel()
            raise StoreUnavailable("lease keep-alive stream closed without an answer")

        ttl = await self._call("keepalive", once, timeout)
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        return ttl

    async def revoke_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        with contextlib.suppress(LeaseNotFound):
            await self._call("revoke", lambda t: self._leases.revoke(lease_id, timeout=t), timeout)

    async def lease_ttl(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        resp = await self._call("lease ttl", lambda t: self._leases.time_to_live(lease_id, timeout=t), timeout)
        return int(resp.TTL)

    # ------------------------------------------------------------------- watch

    async def watch(self, query: WatchQuery) -> AsyncIterator[WatchBatch]:
        prefix, progress_interval_s = query.prefix, query.progress_interval_s
        # "From now" is pinned to a revision up front, so a reconnect cannot skip events.
        next_rev = query.start_revision or await self.current_revision(timeout=self.default_timeout) + 1
        key = prefix or b"\x00"
        end = prefix_range_end(prefix) if prefix else b"\x00"
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        backoff = Backoff(_RETRY_BACKOFF_S, _MAX_BACKOFF_S)
        while True:
            stream = _WatchStream(
                WatchStub(self._channel_now()), key, end, next_rev, progress_interval_s > 0, query.prev_kv
            )
            try:
                async for resp in stream.responses(progress_interval_s):
                    failing_since = None
                    backoff.reset()
                    if resp.events:
                        events = [self._event(e) for e in resp.events]
                        next_rev = events[-1].kv.mod_revision + 1
                        yield WatchBatch(events, next_rev - 1)
                    elif int(resp.header.revision) >= next_rev - 1:  # a progress notification
                        next_rev = int(resp.header.revision) + 1
                        yield WatchBatch([], next_rev - 1)
            except _WatchBroken as exc:
                now = loop.time()
                failing_since = failing_since or now
                if now - failing_since > self._watch_unavailable_after_s:
                    raise StoreUnavailable(f"etcd watch down for {now - failing_since:.1f}s: {exc}") from exc
                _log.info("etcd watch on %r broke (%s); resuming from revision %d", prefix, exc, next_rev)
                await backoff.sleep()
            finally:
                await stream.close()

    @staticmethod
    def _event(pb: Any) -> WatchEvent:
        prev = _kv(pb.prev_kv) if pb.HasField("prev_kv") else None
        kind = EventType.DELETE if pb.type == _MVCC_EVENT_DELETE else EventType.PUT
        return WatchEvent(kind, _kv(pb.kv), prev)

    # ------------------------------------------------------------------ space

    def writes_refused(self) -> str | None:
        return NO_SPACE_REASON if self._no_space_since is not None else None

    def _refused_for_space(self, name: str) -> None:
        """A write was refused for NOSPACE: enter the episode (logged once) and watch for its end."""
        if self._no_space_since is not None:
            return
        self._no_space_since = time.monotonic()
        self.no_space_episodes += 1
        _log.error(
            "etcd refuses writes (%s, first seen on %s): registrations, lease grants and checkpoints fail with "
            "STORE_NO_SPACE; reads, renewals and turns go on (fail open to recompute). An operator must compact, "
            "defragment and disarm (docs/etcd-space.md); writes resume here without a restart",
            NO_SPACE_REASON,
            name,
        )
        if self._no_space_probe is None or self._no_space_probe.done():
            self._no_space_probe = asyncio.get_running_loop().create_task(self._probe_alarm(), name="etcd-nospace")

    def _wrote(self, sent: float) -> None:
        """A write sent at ``sent`` (monotonic) was applied: a NOSPACE episode that began before it is over (one
        sent earlier may have been applied before the alarm and answered after it)."""
        if self._no_space_since is not None and sent > self._no_space_since:
            self._space_back("a write succeeded")

    def _space_back(self, how: str) -> None:
        since, self._no_space_since = self._no_space_since, None
        if since is not None:
            _log.warning("etcd accepts writes again after %.1fs (%s)", time.monotonic() - since, how)

    async def _probe_alarm(self) -> None:
        """While writes are refused: ask etcd's alarm list each second; end the episode once NOSPACE is gone.
        (A failed ask changes nothing: a successful write ends the episode too.)"""
        request = rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.GET, memberID=0, alarm=rpc_pb2.NONE)
        while self._no_space_since is not None and not self._closed:
            await asyncio.sleep(_NO_SPACE_PROBE_S)
            try:
                resp = await MaintenanceStub(self._channel_now()).Alarm(request, timeout=self.default_timeout)
            except (grpc.aio.AioRpcError, StoreUnavailable) as exc:
                _log.debug("etcd alarm list failed: %s", exc)
                continue
            if not any(a.alarm == rpc_pb2.NOSPACE for a in resp.alarms):
                self._space_back("NOSPACE alarm disarmed")

    async def close(self) -> None:
        self._closed = True
        if self._no_space_probe is not None:
            self._no_space_probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._no_space_probe
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class _WatchBroken(Exception):
    """The watch stream failed in a way a reconnect can fix."""


class _WatchStream:
    """One etcd watch stream; a reader task pumps responses so reads are never cancelled
    (cancelling a grpc.aio read cancels the whole call)."""

    def __init__(
        self, stub: Any, key: bytes, end: bytes, start_revision: int, progress_notify: bool, prev_kv: bool
    ) -> None:
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self._requests.put_nowait(
            WatchRequest(
                create_request=WatchCreateRequest(
                    key=key,
                    range_end=end,
                    start_revision=start_revision,
                    prev_kv=prev_kv,
                    progress_notify=progress_notify,
                    fragment=True,
                )
            )
        )
        self._call = stub.Watch(self._request_iter(), metadata=_WATCH_METADATA)
        self._responses: asyncio.Queue[Any] = asyncio.Queue(maxsize=_WATCH_QUEUE)
        self._reader = asyncio.get_running_loop().create_task(self._pump())

    async def _request_iter(self) -> AsyncIterator[Any]:
        while True:
            yield await self._requests.get()

    async def _pump(self) -> None:
        try:
            async for resp in self._call:
                await self._responses.put(resp)
            await self._responses.put(_WatchBroken("stream ended"))
        except grpc.aio.AioRpcError as exc:
            await self._responses.put(exc)

    async def responses(self, progress_interval_s: float) -> AsyncIterator[Any]:
        """Event and progress responses, a fragmented revision put back together; raises Compacted,
        _WatchBroken, or a non-transient error."""
        fragments: list[Any] = []  # the events of a fragmented response so far
        while True:
            try:
                async with asyncio.timeout(progress_interval_s if progress_interval_s > 0 else None):
                    item = await self._responses.get()
            except TimeoutError:
                # Idle: ask for a progress notification (answered with the current revision).
                self._requests.put_nowait(WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
                continue
            if isinstance(item, _WatchBroken):
                raise item
            if isinstance(item, grpc.aio.AioRpcError):
                if item.code() in (*_TRANSIENT, grpc.StatusCode.CANCELLED):
                    raise _WatchBroken(f"{item.code().name}: {item.details()}")
                raise StoreError(f"etcd watch failed: {item.code().name}: {item.details()}")
            if item.compact_revision:
                raise Compacted(int(item.compact_revision))
            if item.canceled:
                raise _WatchBroken(f"watch canceled by etcd: {item.cancel_reason or 'no reason'}")
            if item.created:
                continue
            if item.fragment:  # more of the same revision follows
                fragments.extend(item.events)
                continue
            if fragments:
                whole = rpc_pb2.WatchResponse()
                whole.CopyFrom(item)
                del whole.events[:]
                whole.events.extend([*fragments, *item.events])
                fragments = []
                item = whole
            yield item

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._reader
