"""Entry registration at the store: read, decide (``registration.decide``), compare-and-swap write; one by one,
or through group commit (``batcher.py``, docs/adr/0005). Acknowledged only once the write committed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.store.base import Compare, Get, KeyValue, LeaseNotFound, Put, Store

from . import validation as v
from .batcher import BatchJob, BatchLimits, PlannedWrite, RegistrationBatcher
from .cas import CAS_ATTEMPTS, contention, exists
from .config import RegistrySettings
from .evictions import EntryEvictor
from .leases import lease_gone
from .parts import RegistryParts
from .records import compact, now_ts, request_record
from .registration import Registration, Replay, decide

Response = registry_pb2.RegisterEntryResponse


class IdempotencyLease:
    """One store lease per time window; idempotency records attach to it, so they vanish after ~TTL."""

    def __init__(self, store: Store, ttl_s: int, timeout_s: float) -> None:
        self._store, self._ttl_s, self._timeout_s = store, ttl_s, timeout_s
        self._lease_id = 0
        self._granted_at = 0.0
        self._lock = asyncio.Lock()

    async def current(self) -> int:
        # Renewed at half-life: a record written now lives between TTL/2 and TTL.
        if self._lease_id and time.monotonic() - self._granted_at < self._ttl_s / 2:
            return self._lease_id
        async with self._lock:
            if not self._lease_id or time.monotonic() - self._granted_at >= self._ttl_s / 2:
                self._lease_id = await self._store.grant_lease(self._ttl_s, timeout=self._timeout_s)
                self._granted_at = time.monotonic()
            return self._lease_id


class _GroupCommitHandler:
    """The registrar's decisions, as the batcher asks for them."""

    def __init__(self, registrar: Registrar) -> None:
        self._registrar = registrar

    async def decide(
        self, job: BatchJob[Response], reads: Mapping[bytes, KeyValue | None]
    ) -> Response | PlannedWrite[Response]:
        assert isinstance(job.payload, Registration)
        return await self._registrar.decide(job.payload, reads)

    async def commit_alone(self, job: BatchJob[Response], plan: PlannedWrite[Response]) -> Response:
        assert isinstance(job.payload, Registration)
        return await self._registrar.register_alone(job.payload, plan)


class Registrar:
    def __init__(
        self, parts: RegistryParts, settings: RegistrySettings, evictor: EntryEvictor, *, group_commit: bool
    ) -> None:
        self._parts = parts
        self._settings = settings
        self._evictor = evictor
        self._idem = IdempotencyLease(parts.store, settings.idempotency_ttl_s, parts.timeout_s)
        self.batcher: RegistrationBatcher[Response] | None = None
        if group_commit:
            batch_limits = BatchLimits(
                window_s=settings.register_batch_window_ms / 1000,
                max_batch=settings.register_batch_max,
                max_txn_ops=settings.register_batch_max_txn_ops,
                max_txn_bytes=settings.register_batch_max_bytes,
                max_inflight=settings.register_batch_max_inflight,
            )
            self.batcher = RegistrationBatcher(
                parts.store, _GroupCommitHandler(self), batch_limits, timeout_s=parts.timeout_s
            )

    async def register_entry(self, principal: Principal, request: registry_pb2.RegisterEntryRequest) -> Response:
        v.check_register_request(request, self._parts.limits)
        tenant = principal.tenant_for(request.entry.key.tenant, field="entry.key.tenant")
        entry, digest = compact(
            request.entry,
            tenant,
            stride=self._settings.chain_stride,
            exact_tail_blocks=self._settings.chain_exact_tail_blocks,
            register_time=now_ts(self._parts.clock),
        )
        key = entry.key
        reg = Registration(
            request_id=request.request_id,
            entry=entry,
            digest=digest,
            entry_key=self._parts.keys.entry(tenant, key.model, key.conversation_key),
            request_key=self._parts.keys.registry_request(request.request_id),
            lease_key=self._parts.keys.lease(entry.lease_id),
            engine_key=self._parts.keys.engine(entry.engine_id),
            asserted_incarnation=request.entry.engine_incarnation,
            closed_key=self._parts.keys.closed(tenant, key.model, key.conversation_key),
        )
        if self.batcher is None:
            return await self.register_alone(reg, None)
        job: BatchJob[Response] = BatchJob(
            exclusive_keys=(reg.entry_key, reg.request_key),
            read_keys=reg.read_keys,
            # Entry value twice (entry + response in the idempotency record) plus keys and digest.
            size_hint=2 * entry.ByteSize() + 512,
            payload=reg,
        )
        return await self.batcher.submit(job)

    async def close(self) -> None:
        """Stop group commit; registrations still queued are answered UNAVAILABLE."""
        if self.batcher is not None:
            await self.batcher.close()

    async def register_alone(self, reg: Registration, plan: PlannedWrite[Response] | None) -> Response:
        """Read, decide and CAS-write one registration, re-reading on conflict (``plan``: already decided)."""
        for _ in range(CAS_ATTEMPTS):
            if plan is None:
                snap = await self._parts.store.txn([], [Get(k) for k in reg.read_keys], timeout=self._parts.timeout_s)
                outcome = await self.decide(reg, dict(zip(reg.read_keys, snap.gets, strict=True)))
                if not isinstance(outcome, PlannedWrite):
                    return outcome
                plan = outcome
            try:
                result = await self._parts.store.txn(plan.compares, plan.puts, timeout=self._parts.timeout_s)
            except LeaseNotFound:
                raise lease_gone("entry.lease_id") from None
            if result.succeeded:
                return plan.on_commit(result.revision)
            # Someone changed the entry, lease, engine or request record in between: re-read and decide again.
            plan = None
        raise contention()

    async def decide(
        self, reg: Registration, reads: Mapping[bytes, KeyValue | None]
    ) -> Response | PlannedWrite[Response]:
        """From one snapshot: the answer (replay), the error, or the CAS write to commit (making room under
        the tenant cap first when the write needs it)."""
        decision = decide(reg, reads)
        if isinstance(decision, Replay):
            return decision.response
        entry, current = reg.entry, decision.current
        entry.engine_incarnation = decision.incarnation
        if decision.needs_room:
            key = entry.key
            await self._evictor.make_room(key.tenant, (key.tenant, key.model, key.conversation_key))
        response = Response(entry=entry, superseded_epoch=current.epoch if current is not None else 0)
        current_kv, lease_kv, engine_kv = reads[reg.entry_key], reads[reg.lease_key], reads[reg.engine_key]
        assert lease_kv is not None and engine_kv is not None
        cas = (
            Compare.absent(reg.entry_key)
            if current_kv is None
            else Compare.mod_revision_is(reg.entry_key, current_kv.mod_revision)
        )
        # A close landing between the read and the write sends the registration back to be refused.
        closed_kv = reads.get(reg.closed_key) if reg.closed_key else None
        unclosed = (
            ()
            if not reg.closed_key
            else (
                Compare.absent(reg.closed_key)
                if closed_kv is None
                else Compare.mod_revision_is(reg.closed_key, closed_kv.mod_revision),
            )
        )
        idem_lease = await self._idem.current()

        def on_commit(revision: int) -> Response:
            self._parts.index.put_entry(entry, revision)
            if current is not None and current.lease_id != entry.lease_id:
                self._parts.revoker.submit(current.lease_id, types_pb2.REVOKE_REASON_SUPERSEDED)
            return response

        return PlannedWrite(
            # The engine record unchanged since the read: the entry is bound to the incarnation registered now.
            compares=(
                cas,
                exists(reg.lease_key),
                Compare.mod_revision_is(reg.engine_key, engine_kv.mod_revision),
                Compare.absent(reg.request_key),
                *unclosed,
            ),
            puts=(
                Put(reg.entry_key, entry.SerializeToString(), lease=lease_kv.lease),
                Put(reg.request_key, request_record(reg.digest, response), lease=idem_lease),
            ),
            on_commit=on_commit,
        )
