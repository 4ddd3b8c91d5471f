"""gRPC servicer of kvbridge.lease.v1.LeaseService: validation, auth, translation to the manager."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvbridge import ids
from kvbridge.errors import (
    InvalidArgument,
    KvbridgeError,
    Reason,
    ResourceExhausted,
    Unavailable,
    invalid_field,
    reason_number,
)
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common import validation as cv
from kvbridge_services.common.auth import Authenticator, Principal
from kvbridge_services.common.authz import caller
from kvbridge_services.common.boundary import rpc_boundary, stream_boundary

from . import validation as v
from .codec import set_duration, set_timestamp, to_proto
from .manager import GrantSpec, LeaseManager
from .table import ENTRY, NODE
from .watchers import ACTIVE

_SNAPSHOT_CHUNK = 500
_EVENTS_PER_MESSAGE = 1000
_DEFAULT_PROGRESS_S = 5.0
_DEFAULT_PAGE = 100
Context = grpc.aio.ServicerContext[Any, Any]


class LeaseServicer(lease_pb2_grpc.LeaseServiceServicer):
    def __init__(self, manager: LeaseManager, auth: Authenticator) -> None:
        self._m = manager
        self._auth = auth
        self._policy = manager.policy

    # --- GrantLease ---

    @rpc_boundary
    async def GrantLease(self, request: lease_pb2.GrantLeaseRequest, context: Context) -> lease_pb2.GrantLeaseResponse:
        principal = caller()
        spec = self._grant_spec(request, principal)
        request_id = ids.REQUEST_ID.check_optional("request_id", request.request_id)
        self._m.require_serving()
        record, evicted = await self._m.grant(spec, request_id, context.time_remaining)
        return lease_pb2.GrantLeaseResponse(lease=to_proto(record), evicted_lease_ids=evicted)

    def _grant_spec(self, r: lease_pb2.GrantLeaseRequest, principal: Principal) -> GrantSpec:
        p = self._policy
        ttl_s = v.ttl(r.ttl, present=r.HasField("ttl"), default_s=p.default_ttl_s, min_s=p.min_ttl_s, max_s=p.max_ttl_s)
        engine_id = sys.intern(ids.ENGINE_ID.check("engine_id", r.engine_id))
        if r.kind == NODE:  # engines only, like every grant (kvbridge_services.common.authz)
            cv.must_be_empty(r.model, "model", "for a NODE lease")
            cv.must_be_empty(r.conversation_key, "conversation_key", "for a NODE lease")
            cv.must_be_empty(r.retained_tokens, "retained_tokens", "for a NODE lease")
            tenant = ids.TENANT.check_optional("tenant", r.tenant)
            return GrantSpec(NODE, tenant, engine_id, "", "", 0, ttl_s)
        if r.kind != ENTRY:
            raise invalid_field("kind", "must be LEASE_KIND_ENTRY or LEASE_KIND_NODE")
        # Interned: thousands of leases share a tenant, model and engine (memory per lease).
        tenant = sys.intern(ids.TENANT.check("tenant", principal.tenant_for(r.tenant)))
        model = sys.intern(ids.MODEL.check("model", r.model))
        conversation_key = ids.CONVERSATION_KEY.check("conversation_key", r.conversation_key)
        return GrantSpec(ENTRY, tenant, engine_id, model, conversation_key, r.retained_tokens, ttl_s)

    # --- KeepAlive ---

    @stream_boundary
    async def KeepAlive(
        self, request_iterator: AsyncIterator[lease_pb2.KeepAliveRequest], context: Context
    ) -> AsyncIterator[lease_pb2.KeepAliveResponse]:
        principal = caller()
        self._m.require_serving()
        idle_s = self._policy.keepalive_idle_s
        requests = aiter(request_iterator)
        while True:
            # An idle stream holds one of its principal's concurrency slots: close it (ADR 0025).
            try:
                async with asyncio.timeout(idle_s):
                    request = await anext(requests)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise Unavailable(
                    Reason.STREAM_IDLE,
                    f"KeepAlive stream closed: no renewal for {idle_s:g}s; open a new stream to renew",
                    metadata={"idle_limit_s": f"{idle_s:g}"},
                ) from None
            self._m.require_serving()  # leadership may have moved while the stream was open
            yield self._renew(request, principal)

    def _renew(self, request: lease_pb2.KeepAliveRequest, principal: Principal) -> lease_pb2.KeepAliveResponse:
        count = len(request.lease_ids) + len(request.conversations)
        limit = self._policy.max_ids_per_keepalive
        if count > limit:
            raise cv.too_large("lease_ids", f"{count} items exceed the limit of {limit} per message", limit=limit)
        tenant = principal.tenant
        response = lease_pb2.KeepAliveResponse()
        statuses = response.statuses
        renew = self._m.renew
        for lease_id in request.lease_ids:
            status = statuses.add()
            status.lease_id = lease_id
            record = renew(lease_id, tenant)
            if record is None:
                if tenant is None:
                    status.reason = self._m.table.ended_reason(lease_id)  # type: ignore[assignment]
                else:  # ids are predictable: a tenant learns nothing of a lease it does not hold, not even its end
                    status.error = types_pb2.ERROR_REASON_LEASE_NOT_FOUND
                continue
            status.alive = True
            set_timestamp(status.deadline, record.deadline)
            set_duration(status.ttl, record.ttl_s)
        for i, ref in enumerate(request.conversations):
            field = f"conversations[{i}]"
            status = statuses.add()
            status.conversation.CopyFrom(ref)
            try:
                conv = (
                    ids.TENANT.check(f"{field}.tenant", principal.tenant_for(ref.tenant, field=f"{field}.tenant")),
                    ids.MODEL.check(f"{field}.model", ref.model),
                    ids.CONVERSATION_KEY.check(f"{field}.conversation_key", ref.conversation_key),
                )
            except KvbridgeError as exc:
                # One bad ref must not end a stream that renews many others (a shared Heartbeater's).
                status.error = reason_number(exc.reason)  # type: ignore[assignment]
                continue
            status.conversation.tenant = conv[0]
            lease_id = self._m.table.conversation_lease(conv) or 0
            record = renew(lease_id, tenant) if lease_id else None
            if record is None:
                continue
            status.lease_id = lease_id
            status.alive = True
            set_timestamp(status.deadline, record.deadline)
            set_duration(status.ttl, record.ttl_s)
        return response

    # --- RevokeLease / GetLease / ListLeases ---

    @rpc_boundary
    async def RevokeLease(
        self, request: lease_pb2.RevokeLeaseRequest, context: Context
    ) -> lease_pb2.RevokeLeaseResponse:
        principal = caller()
        lease_id = cv.required_id(request.lease_id, "lease_id")
        if request.reason not in types_pb2.RevokeReason.values() or not request.reason:
            raise invalid_field("reason", "must be a defined RevokeReason other than UNSPECIFIED")
        record = await self._m.revoke(lease_id, request.reason, principal.tenant)
        return lease_pb2.RevokeLeaseResponse(lease=to_proto(record))

    @rpc_boundary
    async def GetLease(self, request: lease_pb2.GetLeaseRequest, context: Context) -> lease_pb2.GetLeaseResponse:
        principal = caller()
        lease_id = cv.required_id(request.lease_id, "lease_id")
        self._m.require_serving()
        return lease_pb2.GetLeaseResponse(lease=to_proto(self._m.get(lease_id, principal.tenant)))

    @rpc_boundary
    async def ListLeases(self, request: lease_pb2.ListLeasesRequest, context: Context) -> lease_pb2.ListLeasesResponse:
        principal = caller()
        tenant = ""  # an operator listing every tenant
        if principal.tenant is not None or request.tenant:
            tenant = ids.TENANT.check("tenant", principal.tenant_for(request.tenant))
        engine_id = ids.ENGINE_ID.check("engine_id", request.engine_id) if request.engine_id else ""
        if request.kind not in (0, ENTRY, NODE):
            raise invalid_field("kind", "unknown LeaseKind")
        page_size = cv.page_size(
            "page_size", request.page_size, default=_DEFAULT_PAGE, maximum=self._policy.max_page_size
        )
        query = f"{tenant}\0{engine_id}\0{request.kind}"
        after = _parse_page_token(request.page_token, query)
        self._m.require_serving()
        response = lease_pb2.ListLeasesResponse()
        last = 0
        for record in self._m.table.iter_from(after):
            if (tenant and record.tenant != tenant) or (engine_id and record.engine_id != engine_id):
                continue
            if request.kind and record.kind != request.kind:
                continue
            if len(response.leases) == page_size:
                response.next_page_token = _page_token(last, query)
                break
            to_proto(record, response.leases.add())
            last = record.lease_id
        return response

    # --- WatchLeases ---

    @stream_boundary
    async def WatchLeases(
        self, request: lease_pb2.WatchLeasesRequest, context: Context
    ) -> AsyncIterator[lease_pb2.WatchLeasesResponse]:
        caller()  # the authorization table admits engines and operators only: an engine's leases span tenants
        engine_id = ids.ENGINE_ID.check("engine_id", request.engine_id)
        progress_s = _DEFAULT_PROGRESS_S
        if request.HasField("progress_interval"):
            progress_s = cv.duration_s("progress_interval", request.progress_interval)
            if not 0.1 <= progress_s <= 300:
                raise invalid_field("progress_interval", "must be within [0.1s, 300s]")
        self._m.require_serving()
        sub = self._m.hub.subscribe(engine_id)
        if sub is None:
            raise ResourceExhausted(Reason.OVERLOADED, "too many WatchLeases subscribers; retry later")
        try:
            # Subscribed before the snapshot is taken (no await in between): no event can fall in a gap.
            snapshot = self._m.table.of_engine(engine_id)
            for start in range(0, max(len(snapshot), 1), _SNAPSHOT_CHUNK):
                message = lease_pb2.WatchLeasesResponse()
                for record in snapshot[start : start + _SNAPSHOT_CHUNK]:
                    event = message.events.add(type=ACTIVE)
                    to_proto(record, event.lease)
                message.snapshot_complete = start + _SNAPSHOT_CHUNK >= len(snapshot)
                yield message
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sub.wake.wait(), progress_s)
                if sub.closed_reason:
                    raise Unavailable(
                        Reason.NOT_LEADER, f"watch closed: {sub.closed_reason}; reconnect", metadata={"leader": ""}
                    )
                if sub.overflowed:
                    raise Unavailable(Reason.OVERLOADED, "watcher fell too far behind; reconnect to re-sync")
                yield lease_pb2.WatchLeasesResponse(events=sub.drain(_EVENTS_PER_MESSAGE))
        finally:
            self._m.hub.unsubscribe(sub)


def _page_token(last_id: int, query: str) -> str:
    return f"{last_id:x}.{_query_tag(query)}"


def _query_tag(query: str) -> str:
    return hashlib.sha256(query.encode()).hexdigest()[:16]


def _parse_page_token(token: str, query: str) -> int:
    if not token:
        return 0
    last, _, tag = token.partition(".")
    try:
        last_id = int(last, 16)
    except ValueError:
        last_id = -1
    if last_id <= 0 or tag != _query_tag(query):
        raise InvalidArgument(
            Reason.INVALID_PAGE_TOKEN,
            "page_token is malformed or belongs to another query",
            metadata={"field": "page_token"},
        )
    return last_id
