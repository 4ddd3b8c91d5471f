"""Talks to the registry and lease manager on a background thread.

The scheduler loop only ``submit``s commands (non-blocking, bounded queue: a full
queue drops the command and logs) and ``drain``s events each step. Every RPC has
a deadline; streams reconnect with capped backoff. Nothing here can stall vLLM.
Entry registrations are traced (when tracing is on): the span starts when the scheduler
queued the command, continues the turn's trace carried in the command, and its RPCs send
that context on in gRPC metadata so the registry's and lease manager's spans join it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2

from kvbridge import hashchain
from kvbridge.backoff import Backoff
from kvbridge.errors import Reason, from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.sdk.channel import ClientOptions, tls_channel
from kvbridge.sdk.lease import LeaseClient
from kvbridge.types.v1 import types_pb2
from kvbridge_connector import tracing
from kvbridge_connector.params import ConversationRef
from kvbridge_connector.retention import RetentionTable
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_connector.tracing import Carrier, ConnectorTracer

# Under "vllm." so vLLM's logging config formats and shows these records.
log = logging.getLogger(f"vllm.{__name__}")

_GRANT_LEASE = "kvbridge.lease.v1.LeaseService/GrantLease"
_REGISTER_ENTRY = "kvbridge.registry.v1.RegistryService/RegisterEntry"
_BACKOFF_INITIAL_S = 0.2
_BACKOFF_MAX_S = 5.0
_RECONNECT_MAX_MS = 2_000


# ---- commands (scheduler -> thread) ----------------------------------------
@dataclass(frozen=True, slots=True)
class RegisterEntry:
    request_id: str
    conversation: ConversationRef
    block_ids: tuple[tuple[int, ...], ...]
    token_ids: tuple[int, ...]  # the retained tokens (len == token_count)
    cache_salt: str
    # The turn's trace context and when the scheduler queued this (Unix ns), for the registration span.
    parent: Carrier = ()
    submitted_ns: int = 0


@dataclass(frozen=True, slots=True)
class RevokeLease:
    lease_id: int
    reason: str  # a types.v1.RevokeReason name


# ---- events (thread -> scheduler) ------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaseBound:
    request_id: str
    lease_id: int


@dataclass(frozen=True, slots=True)
class LeaseAlive:
    lease_id: int


@dataclass(frozen=True, slots=True)
class LeaseEnded:
    lease_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class RegistrationFailed:
    request_id: str
    lease_id: int  # 0: no lease was granted
    # No entry naming the blocks can be in the registry (nothing granted, registration refused, or the
    # lease revoked); False when that is unknown (e.g. a timed-out registration whose revoke failed too).
    withdrawn: bool
    # The registry may have stored the entry (and so offered it): False when it refused it (ADR 0026).
    written: bool = True


@dataclass(frozen=True, slots=True)
class LeaseSnapshot:
    live_lease_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Connection:
    up: bool


Command = RegisterEntry | RevokeLease
Event = LeaseBound | LeaseAlive | LeaseEnded | RegistrationFailed | LeaseSnapshot | Connection


def apply_events(retention: RetentionTable, events: Iterable[Event]) -> None:
    """Tells the retention table what the control-plane thread reported (the scheduler does this each step)."""
    for event in events:
        if isinstance(event, LeaseBound):
            retention.bind_lease(event.request_id, event.lease_id)
        elif isinstance(event, LeaseAlive):
            retention.lease_alive(event.lease_id)
        elif isinstance(event, LeaseEnded):
            retention.lease_ended(event.lease_id)
        elif isinstance(event, RegistrationFailed):
            retention.registration_failed(event.request_id, event.lease_id, event.withdrawn, written=event.written)
        elif isinstance(event, LeaseSnapshot):
            retention.snapshot(event.live_lease_ids)
        elif isinstance(event, Connection):
            retention.set_connected(event.up)


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class ControlPlane:
    """Owns the gRPC channels and an asyncio loop on one daemon thread."""

    def __init__(
        self, settings: ConnectorSettings, engine: types_pb2.Engine, tracer: ConnectorTracer | None = None
    ) -> None:
        self._settings = settings
        self._engine = engine
        # The node lease this process is registered under: its incarnation, asserted on every entry it registers
        # (0 until registered: the registry then binds the entry to the incarnation it knows).
        self._node_lease_id = 0
        self._tracer = tracer or ConnectorTracer(engine_id=engine.engine_id)
        self._commands: queue.Queue[Command] = queue.Queue(maxsize=settings.queue_size)
        self._events: queue.Queue[Event] = queue.Queue(maxsize=settings.queue_size * 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="kvbridge-control-plane", daemon=True)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {settings.api_key}"),) if settings.api_key else ()
        )
        self.dropped_commands = 0
        # Entry leases granted to this process whose end it has not seen (bounded, oldest forgotten): the leases
        # its retained blocks are held under. Touched only on the control-plane thread.
        self._granted: OrderedDict[int, None] = OrderedDict()
        # Live entry leases of this engine that this process was not granted, and when first seen (monotonic):
        # a lease brought back by a restored or repaired store, a previous process's, or a grant whose answer was
        # lost. Nothing of this process holds blocks for them: they are revoked (ADR 0024).
        self._unheld: dict[int, float] = {}
        self.revoked_unheld = 0

    # ---- scheduler-side API (never blocks) -----------------------------
    @property
    def engine_id(self) -> str:
        return str(self._engine.engine_id)

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> bool:
        try:
            self._commands.put_nowait(command)
            return True
        except queue.Full:
            self.dropped_commands += 1
            log.warning("kvbridge control-plane queue full; dropped %s", type(command).__name__)
            return False

    def drain(self, limit: int = 1024) -> list[Event]:
        events: list[Event] = []
        while len(events) < limit:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        return events

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    # ---- thread ----------------------------------------------------------
    def _emit(self, event: Event) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            log.error("kvbridge event queue full; dropped %s", event)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("kvbridge control-plane thread crashed; retained blocks fall back to the TTL")
            self._emit(Connection(up=False))

    async def _main(self) -> None:
        options = [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # Reconnect within ~2 s of the service coming back: gRPC's own backoff (up to 120 s) would fail every
            # call fast long after a lease-manager restart, past the node lease's TTL (ADR 0024).
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", _RECONNECT_MAX_MS),
        ]
        settings = self._settings

        def channel(target: str) -> grpc.aio.Channel:
            return tls_channel(
                target,
                root_certificates=settings.tls_ca,
                private_key=settings.tls_key,
                certificate_chain=settings.tls_cert,
                options=options,
            )

        registry_channel = channel(settings.registry_target)
        self._registry = registry_pb2_grpc.RegistryServiceStub(registry_channel)
        # The SDK's lease client owns the lease channel and follows NOT_LEADER to the leader: every lease call
        # here uses its current stub (self._lease) and reports a failure to it (_lease_failed).
        self._leases = LeaseClient(
            settings.lease_target, ClientOptions(timeout_s=settings.rpc_deadline_s), channel_factory=channel
        )
        tasks = [
            asyncio.create_task(self._node_loop()),
            asyncio.create_task(self._watch_loop()),
            asyncio.create_task(self._command_loop()),
            asyncio.create_task(self._unheld_loop()),
        ]
        try:
            await asyncio.to_thread(self._stop.wait)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await registry_channel.close()
            await self._leases.close()

    @property
    def _lease(self) -> Any:
        """The lease stub of the lease client's current target (the leader after a redirect)."""
        return self._leases.stub

    def _lease_failed(self, exc: BaseException) -> None:
        self._leases.note_failure(exc)

    async def _unary(self, method: Any, request: Any) -> Any:
        return await method(request, timeout=self._settings.rpc_deadline_s, metadata=self._metadata)

    async def _traced_unary(self, name: str, method: Any, request: Any) -> Any:
        """An RPC under a CLIENT span (a no-op when tracing is off) whose context goes out in the metadata."""
        with self._tracer.rpc(name):
            metadata = self._metadata + self._tracer.rpc_metadata()
            return await method(request, timeout=self._settings.rpc_deadline_s, metadata=metadata)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # Node: register the engine under a node lease and keep it alive. The node lease is this process's
    # incarnation: it is kept across control-plane blips (a lease-manager restart or failover, the registry
    # unreachable) and replaced only when the lease manager answers that it is gone (ADR 0024).
    async def _node_loop(self) -> None:
        backoff = Backoff(_BACKOFF_INITIAL_S, _BACKOFF_MAX_S)
        lease_id = 0
        registered = False
        while not self._stop.is_set():
            try:
                if not lease_id:
                    grant = await self._unary(
                        self._lease.GrantLease,
                        lease_pb2.GrantLeaseRequest(
                            kind=lease_pb2.LEASE_KIND_NODE,
                            engine_id=self._engine.engine_id,
                            ttl=_duration(self._settings.node_lease_ttl_s),
                        ),
                    )
                    lease_id, registered = int(grant.lease.lease_id), False
                if not registered:
                    engine = types_pb2.Engine()
                    engine.CopyFrom(self._engine)
                    engine.node_lease_id = lease_id
                    await self._unary(self._registry.RegisterEngine, registry_pb2.RegisterEngineRequest(engine=engine))
                    registered = True
                    self._node_lease_id = lease_id
                    log.info("kvbridge: engine %s registered (node lease %d)", engine.engine_id, lease_id)
                await self._keep_node_alive(lease_id, backoff)
                lease_id = 0  # the lease manager answered that it is gone: a new incarnation
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                self._lease_failed(exc)
                if _lease_gone(exc):
                    lease_id = 0
                log.warning(
                    "kvbridge: node registration/keep-alive failed: %s%s",
                    _describe(exc),
                    f"; keeping node lease {lease_id}" if lease_id else "",
                )
            delay = backoff.next_delay()
            if lease_id:  # retried at least as often as it is renewed, so a takeover's extension is not missed
                delay = min(delay, max(self._settings.node_lease_ttl_s / 3, 0.2))
            await self._sleep(delay)

    async def _keep_node_alive(self, lease_id: int, backoff: Backoff) -> None:
        """Renews the node lease until the lease manager answers it is gone (returns); a failed call raises."""
        interval = max(self._settings.node_lease_ttl_s / 3, 0.2)
        while not self._stop.is_set():
            renewed = await self._renew([lease_id])
            if lease_id not in renewed:
                log.warning("kvbridge: node lease %d lost; re-registering", lease_id)
                return
            backoff.reset()
            await self._sleep(interval)

    async def _renew(self, lease_ids: Sequence[int]) -> set[int]:
        """One KeepAlive round trip; the ids still alive."""
        # The request as an iterable, not call.write(): a write racing the stream's end raises
        # InvalidStateError, which would end the node loop; this way every failure is the AioRpcError.
        call = self._lease.KeepAlive(
            iter([lease_pb2.KeepAliveRequest(lease_ids=list(lease_ids))]),
            metadata=self._metadata,
            timeout=self._settings.rpc_deadline_s,
        )
        alive: set[int] = set()
        async for response in call:
            alive.update(s.lease_id for s in response.statuses if s.alive)
        return alive

    # Entries: follow WatchLeases(engine_id); a (re)connect starts with a snapshot.
    async def _watch_loop(self) -> None:
        backoff = Backoff(_BACKOFF_INITIAL_S, _BACKOFF_MAX_S)
        while not self._stop.is_set():
            snapshot: set[int] = set()
            in_snapshot = True
            try:
                call = self._lease.WatchLeases(
                    lease_pb2.WatchLeasesRequest(engine_id=self._engine.engine_id, progress_interval=_duration(2.0)),
                    metadata=self._metadata,
                )
                async for response in call:
                    for event in response.events:
                        self._handle_lease_event(event, snapshot if in_snapshot else None)
                    if response.snapshot_complete and in_snapshot:
                        in_snapshot = False
                        self._emit(LeaseSnapshot(frozenset(snapshot)))
                        self._emit(Connection(up=True))
                        backoff.reset()
            except grpc.aio.AioRpcError as exc:
                self._lease_failed(exc)
                log.warning("kvbridge: lease watch broken: %s", _describe(exc))
            self._emit(Connection(up=False))
            await self._sleep(backoff.next_delay())

    def _handle_lease_event(self, event: lease_pb2.LeaseEvent, snapshot: set[int] | None) -> None:
        lease = event.lease
        if lease.kind != lease_pb2.LEASE_KIND_ENTRY:
            return
        if event.type == lease_pb2.LeaseEvent.TYPE_ENDED:
            self._granted.pop(lease.lease_id, None)
            self._unheld.pop(lease.lease_id, None)
            self._emit(LeaseEnded(lease.lease_id, types_pb2.RevokeReason.Name(event.reason)))
        elif event.type in (lease_pb2.LeaseEvent.TYPE_ACTIVE, lease_pb2.LeaseEvent.TYPE_RENEWED):
            if snapshot is not None:
                snapshot.add(lease.lease_id)
            if lease.lease_id not in self._granted and len(self._unheld) < 4 * self._settings.max_retained_entries:
                self._unheld.setdefault(lease.lease_id, time.monotonic())
            self._emit(LeaseAlive(lease.lease_id))

    def _granted_to_us(self, lease_id: int) -> None:
        self._granted[lease_id] = None
        self._unheld.pop(lease_id, None)
        while len(self._granted) > 4 * self._settings.max_retained_entries:
            self._granted.popitem(last=False)

    async def _unheld_loop(self) -> None:
        """Revokes live entry leases of this engine that this process does not hold, once a grant in flight can
        no longer explain them (its answer arrives within the RPC deadline of the lease's first event)."""
        wait_s = 2 * self._settings.rpc_deadline_s + 1.0
        while not self._stop.is_set():
            await self._sleep(1.0)
            now = time.monotonic()
            for lease_id in [i for i, seen in self._unheld.items() if now - seen >= wait_s]:
                if lease_id in self._granted:
                    self._unheld.pop(lease_id, None)
                    continue
                try:
                    await self._revoke(RevokeLease(lease_id, "REVOKE_REASON_ENGINE_GONE"))
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    self._lease_failed(exc)
                    log.warning(
                        "kvbridge: revoking lease %d this engine does not hold failed: %s", lease_id, _describe(exc)
                    )
                    continue
                self._unheld.pop(lease_id, None)
                self.revoked_unheld += 1
                log.warning("kvbridge: revoked live lease %d of this engine that it does not hold", lease_id)

    async def _command_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            try:
                command = await loop.run_in_executor(None, self._commands.get, True, 0.5)
            except queue.Empty:
                continue
            try:
                if isinstance(command, RegisterEntry):
                    await self._register_entry(command)
                else:
                    await self._revoke(command)
            except (grpc.aio.AioRpcError, TimeoutError, ValueError) as exc:
                self._lease_failed(exc)
                log.warning("kvbridge: %s failed: %s", type(command).__name__, _describe(exc))

    async def _register_entry(self, command: RegisterEntry) -> None:
        with self._tracer.registration(
            command.request_id,
            command.conversation,
            blocks=sum(len(g) for g in command.block_ids),
            tokens=len(command.token_ids),
            parent=command.parent,
            submitted_ns=command.submitted_ns,
        ) as span:
            try:
                lease_id = await self._grant_and_register(command)
            except _RegistrationError as failed:
                self._emit(RegistrationFailed(command.request_id, failed.lease_id, failed.withdrawn, failed.written))
                raise failed.cause from None
            span.set(tracing.ATTR_LEASE_ID, lease_id)
            span.set(tracing.ATTR_OUTCOME, "registered")
        self._emit(LeaseBound(command.request_id, lease_id))

    async def _grant_and_register(self, command: RegisterEntry) -> int:
        """GrantLease then RegisterEntry; the lease id. A failed RegisterEntry revokes the fresh lease."""
        conv = command.conversation
        block_size = self._engine.block_size
        hashes = hashchain.chain(
            self._settings.hash_secret or b"",
            conv.tenant,
            conv.model,
            command.cache_salt,
            block_size,
            command.token_ids,
        )
        idempotency = _idempotency_key(self._engine.engine_id, command.request_id)
        try:
            grant = await self._traced_unary(
                _GRANT_LEASE,
                self._lease.GrantLease,
                lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_ENTRY,
                    tenant=conv.tenant,
                    engine_id=self._engine.engine_id,
                    model=conv.model,
                    conversation_key=conv.conversation_key,
                    retained_tokens=len(command.token_ids),
                    ttl=_duration(self._settings.entry_lease_ttl_s),
                    request_id=idempotency,
                ),
            )
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            # A grant that timed out may have committed, but without RegisterEntry no entry names the blocks.
            raise _RegistrationError(exc, 0, withdrawn=True) from exc
        lease_id = grant.lease.lease_id
        self._granted_to_us(int(lease_id))
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant=conv.tenant, model=conv.model, conversation_key=conv.conversation_key),
            engine_id=self._engine.engine_id,
            engine_request_id=command.request_id,
            block_ids=[types_pb2.BlockIds(ids=list(group)) for group in command.block_ids],
            block_size=block_size,
            token_count=len(command.token_ids),
            block_hashes=hashes,
            chain_stride=1,
            lease_id=lease_id,
            epoch=conv.epoch,
            engine_incarnation=self._node_lease_id,
        )
        try:
            await self._traced_unary(
                _REGISTER_ENTRY,
                self._registry.RegisterEntry,
                registry_pb2.RegisterEntryRequest(request_id=idempotency, entry=entry),
            )
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            # A refused registration wrote nothing; a timed-out one may have, attached to the lease. End the
            # lease either way (the entry goes with it) so nothing holds blocks for nobody.
            refused = isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in _AMBIGUOUS
            try:
                await self._revoke(RevokeLease(lease_id, "REVOKE_REASON_EXPIRED"))
                revoked = True
            except (grpc.aio.AioRpcError, TimeoutError):
                revoked = False
            raise _RegistrationError(exc, int(lease_id), withdrawn=refused or revoked, written=not refused) from exc
        return int(lease_id)

    async def _revoke(self, command: RevokeLease) -> None:
        """Ends the lease; once the lease manager acknowledges (or no longer knows it) the end is confirmed."""
        try:
            await self._unary(
                self._lease.RevokeLease,
                lease_pb2.RevokeLeaseRequest(
                    lease_id=command.lease_id, reason=types_pb2.RevokeReason.Value(command.reason)
                ),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        self._granted.pop(command.lease_id, None)
        self._emit(LeaseEnded(command.lease_id, command.reason))


# Outcomes after which a registration may or may not have been applied.
_AMBIGUOUS = (
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
)


class _RegistrationError(Exception):
    def __init__(self, cause: BaseException, lease_id: int, *, withdrawn: bool, written: bool = False) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.lease_id = lease_id
        self.withdrawn = withdrawn
        self.written = written  # the registry may have stored the entry


_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def _idempotency_key(engine_id: str, request_id: str) -> str:
    """The idempotency key of one registration: ``engine_id:request_id`` when that is a registry request id
    ([A-Za-z0-9._:-]{1,128}), else ``sha256:`` and the hex digest of it. Never cut or rewritten: vLLM's request
    id embeds the client's ``request_id`` with its unique suffix at the end, so truncating a long one (or
    replacing characters) gave two requests one key, and the registry answered the second with the first's
    record (issue 30)."""
    text = f"{engine_id}:{request_id}"
    if len(text) <= 128 and _KEY_CHARS.issuperset(text):
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _lease_gone(exc: BaseException) -> bool:
    """The registry refused the node lease as gone (expired, revoked, or retired with an older generation)."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    return from_rpc_error(exc).reason in (Reason.LEASE_NOT_FOUND, Reason.LEASE_MISMATCH)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
