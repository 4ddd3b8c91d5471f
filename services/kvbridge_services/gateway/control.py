"""The gateway's view of the control plane: registry and lease manager, over gRPC only.

Every call has a deadline. Callers treat :class:`ControlPlaneError` as "no reuse this turn"
(fail open to recompute), never as a client error.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from kvbridge.errors import KvbridgeError, from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.sdk.channel import ClientOptions
from kvbridge.sdk.lease import LeaseClient
from kvbridge.sdk.registry import lookup_request
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.channels import peer_channel
from kvbridge_services.common.config import PeerTlsSettings
from kvbridge_services.common.telemetry import client_interceptors

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
_REGISTRY = "kvbridge.registry.v1.RegistryService/"
_LEASE = "kvbridge.lease.v1.LeaseService/"


@dataclass(frozen=True, slots=True)
class KeyedLookup:
    """A keyed lookup, as the entry copy (mirror.py) and the registry (:meth:`ControlPlane.lookup`) both take it."""

    tenant: str
    model: str
    conversation_key: str
    block_hashes: Sequence[bytes]
    block_size: int
    min_tokens: int


class ControlPlaneError(Exception):
    """The registry or lease manager failed or is not configured."""

    def __init__(self, message: str, *, reason: str = "", code: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code  # the gRPC status name, when the failure was a call's


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _traced(
    name: str,
) -> Callable[
    [Callable[Concatenate[ControlPlane, P], Awaitable[R]]], Callable[Concatenate[ControlPlane, P], Awaitable[R]]
]:
    """A CLIENT span around a control-plane call made within a turn's trace; its context travels in the
    call's metadata (client interceptors). Background calls outside any trace (engine list refresh, node
    lease renewal) stay untraced rather than opening a root trace every few seconds."""

    def decorate(
        fn: Callable[Concatenate[ControlPlane, P], Awaitable[R]],
    ) -> Callable[Concatenate[ControlPlane, P], Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(self: ControlPlane, *args: P.args, **kwargs: P.kwargs) -> R:
            if not trace.get_current_span().get_span_context().is_valid:
                return await fn(self, *args, **kwargs)
            with self._tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT):
                return await fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]  # functools.wraps vs Concatenate

    return decorate


class ControlPlane:
    def __init__(
        self,
        registry_address: str,
        lease_address: str,
        *,
        api_key: str | None,
        timeout_s: float,
        tracer: trace.Tracer | None = None,
        tls: PeerTlsSettings | None = None,
        registry_connections: int = 1,
    ) -> None:
        self._timeout = timeout_s
        self._tracer = tracer or trace.get_tracer("kvbridge.gateway")
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channels: list[grpc.aio.Channel] = []
        # The SDK's lease client: it follows NOT_LEADER to the leader (one attempt more for that redirect).
        self._lease: LeaseClient | None = None
        self._stream_target = ""  # where the last KeepAlive stream went (open_keep_alive)
        # Calls rotate over the registry connections: a replica with several server processes serves each
        # connection from one of them.
        self._registry_stubs: list[registry_pb2_grpc.RegistryServiceAsyncStub] = []
        self._next_registry = 0
        if registry_address:
            for _ in range(max(1, registry_connections)):
                ch = peer_channel(
                    registry_address, tls, interceptors=client_interceptors(), own_connection=registry_connections > 1
                )
                self._channels.append(ch)
                self._registry_stubs.append(registry_pb2_grpc.RegistryServiceStub(ch))
        if lease_address:
            self._lease = LeaseClient(
                lease_address,
                ClientOptions(
                    api_key=api_key, timeout_s=timeout_s, max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05
                ),
                channel_factory=lambda target: peer_channel(target, tls, interceptors=client_interceptors()),
            )

    @property
    def enabled(self) -> bool:
        return bool(self._registry_stubs) and self._lease is not None

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
        if self._lease is not None:
            await self._lease.close()

    def _reg(self) -> registry_pb2_grpc.RegistryServiceAsyncStub:
        if not self._registry_stubs:
            raise ControlPlaneError("no registry configured")
        self._next_registry = (self._next_registry + 1) % len(self._registry_stubs)
        return self._registry_stubs[self._next_registry]

    def _lse(self) -> LeaseClient:
        if self._lease is None:
            raise ControlPlaneError("no lease manager configured")
        return self._lease

    @staticmethod
    def _wrap(exc: grpc.RpcError | KvbridgeError, what: str) -> ControlPlaneError:
        err: KvbridgeError = exc if isinstance(exc, KvbridgeError) else from_rpc_error(exc)
        return ControlPlaneError(f"{what}: {err}", reason=err.reason or err.code.name, code=err.code.name)

    async def _ask(self, what: str, method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp], request: Req) -> Resp:
        """One unary registry call under the control plane's deadline and credentials, its failure wrapped."""
        try:
            return await method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._wrap(exc, what) from exc

    # -- registry ----------------------------------------------------------------------
    @_traced(_REGISTRY + "LookupEntry")
    async def lookup(self, query: KeyedLookup) -> registry_pb2.LookupEntryResponse:
        q = query
        req = lookup_request(q.tenant, q.model, q.conversation_key, q.block_hashes, q.block_size, q.min_tokens)
        return await self._ask("LookupEntry", self._reg().LookupEntry, req)

    async def watch_entries(
        self, *, progress_interval_s: float, lifetime_s: float
    ) -> AsyncIterator[registry_pb2.WatchEntriesResponse]:
        """Every tenant's entries (a service principal's watch): a snapshot, then changes, until the stream's
        deadline ``lifetime_s``. Untraced: it outlives any one turn."""
        req = registry_pb2.WatchEntriesRequest(progress_interval=_duration(progress_interval_s))
        call = self._reg().WatchEntries(req, timeout=lifetime_s, metadata=self._metadata)
        try:
            async for message in call:
                yield message
        except grpc.RpcError as exc:
            raise self._wrap(exc, "WatchEntries") from exc
        finally:
            call.cancel()

    @_traced(_REGISTRY + "GetEntry")
    async def entry_epoch(self, *, tenant: str, model: str, conversation_key: str) -> int:
        """The stored epoch of a conversation's entry, 0 when there is none."""
        key = registry_pb2.EntryKey(tenant=tenant, model=model, conversation_key=conversation_key)
        try:
            resp = await self._reg().GetEntry(
                registry_pb2.GetEntryRequest(key=key), timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise self._wrap(exc, "GetEntry") from exc
        return int(resp.entry.epoch)

    @_traced(_REGISTRY + "RegisterEntry")
    async def register_entry(self, entry: registry_pb2.Entry) -> registry_pb2.RegisterEntryResponse:
        req = registry_pb2.RegisterEntryRequest(request_id=f"gw-{uuid.uuid4().hex}", entry=entry)
        return await self._ask("RegisterEntry", self._reg().RegisterEntry, req)

    @_traced(_REGISTRY + "DeleteEntry")
    async def delete_entry(self, *, tenant: str, model: str, conversation_key: str) -> None:
        key = registry_pb2.EntryKey(tenant=tenant, model=model, conversation_key=conversation_key)
        req = registry_pb2.DeleteEntryRequest(key=key, reason=types_pb2.REVOKE_REASON_EXPIRED)
        try:
            await self._reg().DeleteEntry(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise self._wrap(exc, "DeleteEntry") from exc

    @_traced(_REGISTRY + "DeleteEntry")
    async def consume_entry(self, *, tenant: str, model: str, conversation_key: str, epoch: int) -> bool:
        """Takes a single-use entry (compatibility mode): deletes it only if its stored epoch is still ``epoch``,
        in one compare-and-delete. True: this caller took it and may pull its blocks; False: another caller (any
        gateway replica, before a restart too) took it first, or a newer entry replaced it, and nothing is
        deleted. Fails (ControlPlaneError) when the registry cannot be asked: then nobody may pull."""
        key = registry_pb2.EntryKey(tenant=tenant, model=model, conversation_key=conversation_key)
        req = registry_pb2.DeleteEntryRequest(key=key, reason=types_pb2.REVOKE_REASON_EXPIRED, expected_epoch=epoch)
        try:
            resp = await self._reg().DeleteEntry(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return False
            raise self._wrap(exc, "DeleteEntry") from exc
        return int(resp.entry.epoch) == epoch

    @_traced(_REGISTRY + "ListEngines")
    async def list_engines(self, page_limit: int = 20) -> list[types_pb2.Engine]:
        engines: list[types_pb2.Engine] = []
        token = ""
        for _ in range(page_limit):
            req = registry_pb2.ListEnginesRequest(page_size=500, page_token=token)
            resp = await self._ask("ListEngines", self._reg().ListEngines, req)
            engines.extend(resp.engines)
            token = resp.next_page_token
            if not token:
                break
        return engines

    @_traced(_REGISTRY + "RegisterEngine")
    async def register_engine(self, engine: types_pb2.Engine) -> types_pb2.Engine:
        req = registry_pb2.RegisterEngineRequest(engine=engine)
        resp = await self._ask("RegisterEngine", self._reg().RegisterEngine, req)
        registered: types_pb2.Engine = resp.engine
        return registered

    # -- lease manager -------------------------------------------------------------------
    @_traced(_LEASE + "GrantLease")
    async def grant_lease(
        self,
        *,
        kind: int,
        tenant: str = "",
        engine_id: str,
        model: str = "",
        conversation_key: str = "",
        retained_tokens: int = 0,
        ttl_s: float,
    ) -> int:
        try:
            resp = await self._lse().grant(
                kind=kind,
                tenant=tenant,
                engine_id=engine_id,
                model=model,
                conversation_key=conversation_key,
                retained_tokens=retained_tokens,
                ttl_s=ttl_s,
                request_id=f"gw-{uuid.uuid4().hex}",
            )
        except KvbridgeError as exc:
            raise self._wrap(exc, "GrantLease") from exc
        return int(resp.lease.lease_id)

    @_traced(_LEASE + "RevokeLease")
    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._lse().revoke(lease_id, types_pb2.REVOKE_REASON_OPERATOR)
        except KvbridgeError as exc:
            raise self._wrap(exc, "RevokeLease") from exc

    def open_keep_alive(
        self, *, timeout_s: float
    ) -> grpc.aio.StreamStreamCall[lease_pb2.KeepAliveRequest, lease_pb2.KeepAliveResponse]:
        """A KeepAlive stream the caller keeps open (deadline ``timeout_s``) and must cancel. Untraced:
        it outlives any one turn. Report how it failed with ``lease_stream_failed`` (follows NOT_LEADER)."""
        client = self._lse()
        self._stream_target = client.target
        call: grpc.aio.StreamStreamCall[lease_pb2.KeepAliveRequest, lease_pb2.KeepAliveResponse] = (
            client.stub.KeepAlive(timeout=timeout_s, metadata=self._metadata)
        )
        return call

    def lease_stream_failed(self, exc: BaseException) -> None:
        """The stream of ``open_keep_alive`` failed: the lease client moves to the leader a NOT_LEADER names
        (or back to the configured address), so the next stream goes there."""
        if self._lease is not None:
            self._lease.note_failure(exc, self._stream_target)

    @_traced(_LEASE + "KeepAlive")
    async def keep_alive(self, *, lease_ids: Sequence[int]) -> list[lease_pb2.LeaseStatus]:
        """One KeepAlive round trip renewing leases by id (the gateway's engines' node leases)."""
        try:
            return await self._lse().renew_once(list(lease_ids))
        except KvbridgeError as exc:
            raise self._wrap(exc, "KeepAlive") from exc
