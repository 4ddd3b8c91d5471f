"""Registry logic: registrations (durable, CAS on epoch, idempotent), lookups (from memory)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import timestamp_pb2

from kvbridge.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    ResourceExhausted,
    invalid_field,
)
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.entrylookup import answer_hit, unusable
from kvbridge_services.common.hashrecord import HashRecord
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import (
    Compare,
    CompareTarget,
    Delete,
    Get,
    KeyValue,
    LeaseNotFound,
    Put,
    Store,
)

from . import validation as v
from .batcher import BatchJob, BatchLimits, PlannedWrite, RegistrationBatcher
from .config import RegistrySettings
from .index import EntryId, IndexedEntry, RegistryIndex
from .releaser import BackgroundRevoker

log = logging.getLogger(__name__)
# Why the registry itself removed an entry (a label of kvbridge_registry_entries_evicted_total).
EVICTED_TENANT_CAP = "tenant_cap"

_CAS_ATTEMPTS = 5
_RECORD_VERSION = b"\x01"
# The type only: members are read as registry_pb2.LOOKUP_VERDICT_* (the enum wrapper's __getattr__ is slower)
Verdict = registry_pb2.LookupVerdict


def _now_ts(clock: Callable[[], float]) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(clock() * 1e9))
    return ts


def _exists(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, ">", 0)


def write_record(stored: registry_pb2.Entry, record: HashRecord) -> None:
    """Replaces ``stored``'s whole chain with the compact record the registry persists."""
    del stored.block_hashes[:]
    stored.block_hashes.extend(record.checkpoints)
    stored.chain_stride = record.stride
    stored.final_block_hash = record.final
    stored.tail_block_hashes = record.packed_tail()
    stored.tail_start_block = record.tail_start


def _digest_of(entry: registry_pb2.Entry) -> bytes:
    return hashlib.sha256(entry.SerializeToString(deterministic=True)).digest()


def _content_digest(entry: registry_pb2.Entry) -> bytes:
    """Digest of what a registration stores, ignoring the server-set register_time and engine_incarnation."""
    if not entry.HasField("register_time") and not entry.engine_incarnation:
        return _digest_of(entry)
    copy = registry_pb2.Entry()
    copy.CopyFrom(entry)
    copy.ClearField("register_time")
    copy.ClearField("engine_incarnation")
    return _digest_of(copy)


class _IdempotencyLease:
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


@dataclass(frozen=True, slots=True)
class _Registration:
    """A validated registration: the compacted entry and the store keys it reads and writes."""

    request_id: str
    entry: registry_pb2.Entry
    digest: bytes
    entry_key: bytes
    request_key: bytes
    lease_key: bytes
    engine_key: bytes
    # The engine incarnation the caller registers for (0: whichever is registered now).
    asserted_incarnation: int = 0

    @property
    def read_keys(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.request_key, self.entry_key, self.lease_key, self.engine_key)


class _GroupCommitHandler:
    """The registry's decisions, as the batcher asks for them."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def decide(
        self, job: BatchJob[registry_pb2.RegisterEntryResponse], reads: Mapping[bytes, KeyValue | None]
    ) -> registry_pb2.RegisterEntryResponse | PlannedWrite[registry_pb2.RegisterEntryResponse]:
        assert isinstance(job.payload, _Registration)
        return await self._registry._decide(job.payload, reads)

    async def commit_alone(
        self, job: BatchJob[registry_pb2.RegisterEntryResponse], plan: PlannedWrite[registry_pb2.RegisterEntryResponse]
    ) -> registry_pb2.RegisterEntryResponse:
        assert isinstance(job.payload, _Registration)
        return await self._registry._register_alone(job.payload, plan)


class Registry:
    def __init__(
        self,
        store: Store,
        keys: KeyLayout,
        settings: RegistrySettings,
        index: RegistryIndex,
        revoker: BackgroundRevoker,
        *,
        store_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        group_commit: bool = False,
    ) -> None:
        self._store = store
        self._keys = keys
        self._settings = settings
        self.index = index
        self.evictions: dict[str, int] = {}  # entries the registry removed itself, by reason (never loss)
        self._revoker = revoker
        self._timeout = store_timeout_s
        self._clock = clock
        self.limits = v.Limits(settings.max_blocks_per_chain, settings.max_kv_groups)
        self._idem = _IdempotencyLease(store, settings.idempotency_ttl_s, store_timeout_s)
        self._batcher: RegistrationBatcher[registry_pb2.RegisterEntryResponse] | None = None
        self._background: set[asyncio.Task[object]] = set()
        if group_commit:
            limits = BatchLimits(
                window_s=settings.register_batch_window_ms / 1000,
                max_batch=settings.register_batch_max,
                max_txn_ops=settings.register_batch_max_txn_ops,
                max_txn_bytes=settings.register_batch_max_bytes,
                max_inflight=settings.register_batch_max_inflight,
            )
            self._batcher = RegistrationBatcher(store, _GroupCommitHandler(self), limits, timeout_s=store_timeout_s)

    @property
    def batcher(self) -> RegistrationBatcher[registry_pb2.RegisterEntryResponse] | None:
        return self._batcher

    # ------------------------------------------------------------------ engines

    async def register_engine(self, principal: Principal, engine: types_pb2.Engine) -> types_pb2.Engine:
        v.check_engine(engine, self.limits)
        if engine.engine_id not in self.index.engines and len(self.index.engines) >= self._settings.max_engines:
            raise ResourceExhausted(Reason.BUDGET_EXCEEDED, f"at most {self._settings.max_engines} engines")
        lease_key = self._keys.lease(engine.node_lease_id)
        lease_kv = await self._store.get(lease_key, timeout=self._timeout)
        lease = self._parse_lease(lease_kv, "engine.node_lease_id")
        if lease.kind != lease_pb2.LEASE_KIND_NODE or (lease.engine_id and lease.engine_id != engine.engine_id):
            raise FailedPrecondition(
                Reason.LEASE_MISMATCH, "node_lease_id is not this engine's node lease", metadata={"field": "engine"}
            )
        stored = types_pb2.Engine()
        stored.CopyFrom(engine)
        stored.registered_at.CopyFrom(_now_ts(self._clock))
        key = self._keys.engine(engine.engine_id)
        assert lease_kv is not None
        try:
            result = await self._store.txn(
                [_exists(lease_key)],
                [Put(key, stored.SerializeToString(), lease=lease_kv.lease)],
                timeout=self._timeout,
            )
        except LeaseNotFound:
            raise self._lease_gone("engine.node_lease_id") from None
        if not result.succeeded:
            raise self._lease_gone("engine.node_lease_id")
        self.index.put_engine(stored, result.revision)
        previous = self.index.of_other_incarnations(stored)
        if previous:
            # This replica's lookups refuse them already (their incarnation is not the engine's); deleting them
            # and revoking their leases runs off the RPC's path (the engine sweep retries what this misses).
            log.info(
                "engine %s registered as a new incarnation (node lease %d): dropping %d entries of the previous one",
                stored.engine_id,
                stored.node_lease_id,
                len(previous),
            )
            self._spawn(self.drop_other_incarnations(stored.engine_id))
        return stored

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drop_other_incarnations(self, engine_id: str) -> int:
        """Deletes the indexed entries of ``engine_id`` made by another incarnation than the one registered in
        the store now (a previous process under the same id), revoking their leases (ENGINE_GONE).

        Each delete is conditional on the engine record being the one read here, so an index that lags the
        store (an engine re-registered since) never deletes the current incarnation's entries.
        """
        engine_key = self._keys.engine(engine_id)
        kv = await self._store.get(engine_key, timeout=self._timeout)
        if kv is None:
            return 0  # deregistered: lookups answer ENGINE_GONE; the node lease's end revokes the leases
        current = types_pb2.Engine.FromString(kv.value)
        dropped = 0
        for item in self.index.of_other_incarnations(current):
            if await self._delete_indexed(
                item, types_pb2.REVOKE_REASON_ENGINE_GONE, Compare.mod_revision_is(engine_key, kv.mod_revision)
            ):
                dropped += 1
        return dropped

    async def deregister_engine(self, principal: Principal, engine_id: str) -> None:
        v.check_id("engine_id", engine_id)
        if not await self._store.delete(self._keys.engine(engine_id), timeout=self._timeout):
            raise NotFound(Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered")
        self.index.delete_engine(engine_id, await self._store.current_revision(timeout=self._timeout))

    async def sweep_engines(self) -> int:
        """Deregister engines whose node lease record is gone (the lease manager ended it).

        Node leases live in the lease manager's table (docs/adr/0002), not in store
        leases, so the engine record is not deleted by the store on expiry; this sweep
        makes "registered" mean "live" within one sweep interval. Idempotent across replicas.
        """
        removed = 0
        for engine in list(self.index.engines.values()):
            lease_key = self._keys.lease(engine.node_lease_id)
            if await self._store.get(lease_key, timeout=self._timeout) is not None:
                continue
            key = self._keys.engine(engine.engine_id)
            current = await self._store.get(key, timeout=self._timeout)
            if current is None or types_pb2.Engine.FromString(current.value).node_lease_id != engine.node_lease_id:
                continue
            result = await self._store.txn(
                [Compare.mod_revision_is(key, current.mod_revision), Compare.absent(lease_key)],
                [Delete(key)],
                timeout=self._timeout,
            )
            if result.succeeded:
                self.index.delete_engine(engine.engine_id, result.revision)
                log.info("engine %s deregistered: node lease %d ended", engine.engine_id, engine.node_lease_id)
                removed += 1
        for engine_id in list(self.index.suspect_engines):
            self.index.suspect_engines.discard(engine_id)
            await self.drop_other_incarnations(engine_id)
            now = self.index.engines.get(engine_id)
            if now is not None and self.index.of_other_incarnations(now):
                self.index.suspect_engines.add(engine_id)  # a delete lost a race: the next sweep tries again
        return removed

    def get_engine(self, engine_id: str) -> types_pb2.Engine:
        v.check_id("engine_id", engine_id)
        engine = self.index.engines.get(engine_id)
        if engine is None:
            raise NotFound(Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered")
        return engine

    def list_engines(self, request: registry_pb2.ListEnginesRequest) -> registry_pb2.ListEnginesResponse:
        if request.model:
            v.check_model("model", request.model)
        size = v.page_size("page_size", request.page_size)
        after = _decode_page_token(request.page_token, b"engines").decode() if request.page_token else ""
        matching = sorted(
            (
                e
                for e in self.index.engines.values()
                if (not request.model or e.model == request.model)
                and (not request.role or e.role == request.role)
                and e.engine_id > after
            ),
            key=lambda e: e.engine_id,
        )
        page = matching[:size]
        token = _encode_page_token(b"engines", page[-1].engine_id.encode()) if len(matching) > size else ""
        return registry_pb2.ListEnginesResponse(engines=page, next_page_token=token)

    # ------------------------------------------------------------------ register

    def _compact(self, entry: registry_pb2.Entry, tenant: str) -> tuple[registry_pb2.Entry, bytes]:
        """The entry as stored (every stride-th hash, the tail's every hash, server time) and its content
        digest."""
        record = HashRecord.from_chain(
            entry.block_hashes, self._settings.chain_stride, self._settings.chain_exact_tail_blocks
        )
        stored = registry_pb2.Entry()
        stored.CopyFrom(entry)
        stored.key.tenant = tenant
        write_record(stored, record)
        stored.ClearField("engine_incarnation")  # the registry sets it from its engine record
        digest = _digest_of(stored)  # before register_time is set: same as _content_digest, without a copy
        stored.register_time.CopyFrom(_now_ts(self._clock))
        return stored, digest

    async def register_entry(
        self, principal: Principal, request: registry_pb2.RegisterEntryRequest
    ) -> registry_pb2.RegisterEntryResponse:
        v.check_register_request(request, self.limits)
        tenant = principal.tenant_for(request.entry.key.tenant, field="entry.key.tenant")
        entry, digest = self._compact(request.entry, tenant)
        key = entry.key
        reg = _Registration(
            request_id=request.request_id,
            entry=entry,
            digest=digest,
            entry_key=self._keys.entry(tenant, key.model, key.conversation_key),
            request_key=self._keys.registry_request(request.request_id),
            lease_key=self._keys.lease(entry.lease_id),
            engine_key=self._keys.engine(entry.engine_id),
            asserted_incarnation=request.entry.engine_incarnation,
        )
        if self._batcher is None:
            return await self._register_alone(reg, None)
        job: BatchJob[registry_pb2.RegisterEntryResponse] = BatchJob(
            exclusive_keys=(reg.entry_key, reg.request_key),
            read_keys=(reg.request_key, reg.entry_key, reg.lease_key, reg.engine_key),
            # Entry value twice (entry + response in the idempotency record) plus keys and digest.
            size_hint=2 * entry.ByteSize() + 512,
            payload=reg,
        )
        return await self._batcher.submit(job)

    async def close(self) -> None:
        """Stop group commit; registrations still queued are answered UNAVAILABLE."""
        if self._batcher is not None:
            await self._batcher.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def _register_alone(
        self, reg: _Registration, plan: PlannedWrite[registry_pb2.RegisterEntryResponse] | None
    ) -> registry_pb2.RegisterEntryResponse:
        """Read, decide and CAS-write one registration, re-reading on conflict (``plan``: already decided)."""
        for _ in range(_CAS_ATTEMPTS):
            if plan is None:
                snap = await self._store.txn([], [Get(k) for k in reg.read_keys], timeout=self._timeout)
                outcome = await self._decide(reg, dict(zip(reg.read_keys, snap.gets, strict=True)))
                if not isinstance(outcome, PlannedWrite):
                    return outcome
                plan = outcome
            try:
                result = await self._store.txn(plan.compares, plan.puts, timeout=self._timeout)
            except LeaseNotFound:
                raise self._lease_gone("entry.lease_id") from None
            if result.succeeded:
                return plan.on_commit(result.revision)
            # Someone changed the entry, lease, engine or request record in between: re-read and decide again.
            plan = None
        raise Aborted(Reason.OVERLOADED, "too much contention on this conversation; retry")

    async def _decide(
        self, reg: _Registration, reads: Mapping[bytes, KeyValue | None]
    ) -> registry_pb2.RegisterEntryResponse | PlannedWrite[registry_pb2.RegisterEntryResponse]:
        """From one snapshot: the answer (replay), the error, or the CAS write to commit."""
        entry = reg.entry
        record_kv, current_kv = reads[reg.request_key], reads[reg.entry_key]
        lease_kv, engine_kv = reads[reg.lease_key], reads[reg.engine_key]
        if record_kv is not None:
            return _replay(record_kv, reg.digest, reg.request_id)
        engine = self._check_engine(engine_kv, entry)
        if reg.asserted_incarnation and reg.asserted_incarnation != engine.node_lease_id:
            raise FailedPrecondition(
                Reason.ENGINE_RESTARTED,
                f"engine {entry.engine_id!r} registered again (incarnation {engine.node_lease_id}) since these "
                f"blocks were retained (incarnation {reg.asserted_incarnation})",
                metadata={"field": "entry.engine_incarnation", "engine_incarnation": str(engine.node_lease_id)},
            )
        # Bound to the incarnation the registry knows, never to what a caller says (docs/adr/0010).
        entry.engine_incarnation = engine.node_lease_id
        lease = self._parse_lease(lease_kv, "entry.lease_id")
        _check_entry_lease(lease, entry)
        current = registry_pb2.Entry.FromString(current_kv.value) if current_kv is not None else None
        # An entry of a previous incarnation of the same engine is garbage whatever its epoch: replace it.
        if current is not None and not (
            current.engine_id == entry.engine_id and current.engine_incarnation != entry.engine_incarnation
        ):
            if current.epoch > entry.epoch or (current.epoch == entry.epoch and _content_digest(current) != reg.digest):
                raise FailedPrecondition(
                    Reason.STALE_EPOCH,
                    f"stored epoch {current.epoch} supersedes epoch {entry.epoch}",
                    metadata={"field": "entry.epoch", "stored_epoch": str(current.epoch)},
                )
            if current.epoch == entry.epoch:  # the same registration again (request id differs)
                return registry_pb2.RegisterEntryResponse(entry=current, replayed=True)
        else:
            key = entry.key
            await self._make_room(key.tenant, (key.tenant, key.model, key.conversation_key))
        response = registry_pb2.RegisterEntryResponse(
            entry=entry, superseded_epoch=current.epoch if current is not None else 0
        )
        assert lease_kv is not None and engine_kv is not None
        cas = (
            Compare.absent(reg.entry_key)
            if current_kv is None
            else Compare.mod_revision_is(reg.entry_key, current_kv.mod_revision)
        )
        idem_lease = await self._idem.current()

        def on_commit(revision: int) -> registry_pb2.RegisterEntryResponse:
            self.index.put_entry(entry, revision)
            if current is not None and current.lease_id != entry.lease_id:
                self._revoker.submit(current.lease_id, types_pb2.REVOKE_REASON_SUPERSEDED)
            return response

        return PlannedWrite(
            # The engine record unchanged since the read: the entry is bound to the incarnation registered now.
            compares=(
                cas,
                _exists(reg.lease_key),
                Compare.mod_revision_is(reg.engine_key, engine_kv.mod_revision),
                Compare.absent(reg.request_key),
            ),
            puts=(
                Put(reg.entry_key, entry.SerializeToString(), lease=lease_kv.lease),
                Put(reg.request_key, _RECORD_VERSION + reg.digest + response.SerializeToString(), lease=idem_lease),
            ),
            on_commit=on_commit,
        )

    def _check_engine(self, engine_kv: KeyValue | None, entry: registry_pb2.Entry) -> types_pb2.Engine:
        if engine_kv is None:
            raise FailedPrecondition(
                Reason.ENGINE_NOT_FOUND,
                f"engine {entry.engine_id!r} is not registered and live",
                metadata={"field": "entry.engine_id"},
            )
        engine = types_pb2.Engine.FromString(engine_kv.value)
        if engine.model != entry.key.model:
            raise invalid_field("entry.key.model", f"engine {entry.engine_id!r} serves {engine.model!r}")
        if engine.block_size != entry.block_size:
            raise invalid_field("entry.block_size", f"engine {entry.engine_id!r} uses block size {engine.block_size}")
        if engine.kv_group_count and len(entry.block_ids) != engine.kv_group_count:
            raise invalid_field("entry.block_ids", f"engine {entry.engine_id!r} has {engine.kv_group_count} KV groups")
        return engine

    def _parse_lease(self, lease_kv: KeyValue | None, field: str) -> lease_pb2.Lease:
        if lease_kv is None:
            raise self._lease_gone(field)
        return lease_pb2.Lease.FromString(lease_kv.value)

    @staticmethod
    def _lease_gone(field: str) -> FailedPrecondition:
        return FailedPrecondition(
            Reason.LEASE_NOT_FOUND, "the lease does not exist (expired or revoked)", metadata={"field": field}
        )

    async def _make_room(self, tenant: str, incoming: EntryId) -> None:
        """Per-tenant cap: evict the tenant's oldest-idle entry (lease revoked with BUDGET).

        An eviction is recorded, so that it is never mistaken for loss: counted in ``evictions``
        (``kvbridge_registry_entries_evicted_total{reason="tenant_cap"}``) and logged (INFO) with the entry.
        """
        cap = self._settings.max_entries_per_tenant
        while self.index.tenant_count(tenant) >= cap:
            victim = self.index.oldest_idle(tenant, exclude=incoming)
            if victim is None:
                return
            if await self._delete_indexed(victim, types_pb2.REVOKE_REASON_BUDGET):
                self.evictions[EVICTED_TENANT_CAP] = self.evictions.get(EVICTED_TENANT_CAP, 0) + 1
                log.info(
                    "evicted entry %s (tenant at its cap of %d entries; oldest idle; lease %x revoked: BUDGET)",
                    "/".join(victim.id),
                    cap,
                    victim.entry.lease_id,
                )

    async def _delete_indexed(
        self, item: IndexedEntry, reason: types_pb2.RevokeReason.ValueType, *also: Compare
    ) -> bool:
        """Deletes ``item`` if unchanged in the store (and ``also`` holds), revoking its lease with ``reason``."""
        key = self._keys.entry(*item.id)
        result = await self._store.txn(
            [Compare.mod_revision_is(key, item.mod_revision), *also], [Delete(key)], timeout=self._timeout
        )
        # Either we deleted it, or it changed/vanished in the store; the watch brings the truth.
        self.index.delete_entry(item.id, result.revision if result.succeeded else item.mod_revision + 1)
        if result.succeeded:
            self._revoker.submit(item.entry.lease_id, reason)
        return result.succeeded

    # ------------------------------------------------------------------ lookup

    def lookup(
        self, principal: Principal, request: registry_pb2.LookupEntryRequest
    ) -> registry_pb2.LookupEntryResponse:
        prompt = v.check_lookup_request(request, self.limits)
        tenant = principal.tenant_for(request.tenant)
        response = registry_pb2.LookupEntryResponse(prompt_block_tokens=len(prompt) * request.block_size)
        if not self.index.fresh():
            # The index lags the store past its bound: a hit could name an entry deleted meanwhile.
            response.verdict = registry_pb2.LOOKUP_VERDICT_INDEX_STALE
            return response
        if request.conversation_key:
            item = self.index.entries.get((tenant, request.model, request.conversation_key))
            if item is None:
                response.verdict = registry_pb2.LOOKUP_VERDICT_NOT_FOUND
                return response
            verdict = self._unusable(item, request.block_size, self._clock())
            if verdict is not None:
                response.verdict = verdict
                return response
            blocks = item.record.verified_blocks(prompt)
            if blocks == 0:
                response.verdict = registry_pb2.LOOKUP_VERDICT_MISMATCH
                return response
        else:
            best = self._best_content_match(tenant, request.model, request.block_size, prompt)
            if best is None:
                response.verdict = registry_pb2.LOOKUP_VERDICT_NOT_FOUND
                return response
            item, blocks = best
        return self._answer(response, item, blocks, request.min_tokens)

    def _unusable(self, item: IndexedEntry, block_size: int, now_s: float) -> Verdict.ValueType | None:
        return unusable(item.entry, block_size, now_s, self.index.engines.get(item.entry.engine_id))

    def _answer(
        self, response: registry_pb2.LookupEntryResponse, item: IndexedEntry, blocks: int, min_tokens: int
    ) -> registry_pb2.LookupEntryResponse:
        if answer_hit(response, item.entry, self.index.engines[item.entry.engine_id], blocks, min_tokens):
            self.index.touch(item.id)
        return response

    def _best_content_match(
        self, tenant: str, model: str, block_size: int, prompt: Sequence[bytes]
    ) -> tuple[IndexedEntry, int] | None:
        """Longest verified prefix among the tenant's live entries of the model.

        Binary search over the prompt's checkpoint positions for the deepest one
        some entry holds (cumulative chains: holding position j implies matching
        every block below j), then the positions up to the next checkpoint for
        entries whose final block ends there.
        """
        stride = self.index.content_stride
        lo, hi = 0, len(prompt) // stride
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.index.holders(tenant, model, prompt[mid * stride - 1], limit=1):
                lo = mid
            else:
                hi = mid - 1
        cap = self._settings.max_content_candidates
        candidates: list[EntryId] = []
        if lo:
            candidates += self.index.holders(tenant, model, prompt[lo * stride - 1], limit=cap)
        for pos in range(lo * stride, min(len(prompt), (lo + 1) * stride)):
            candidates += self.index.holders(tenant, model, prompt[pos], limit=cap)
        now_s = self._clock()
        best: tuple[IndexedEntry, int] | None = None
        # Bounded work per lookup: many conversations sharing one prefix must not make lookups slow.
        for eid in candidates[: 2 * cap]:
            item = self.index.entries.get(eid)
            if item is None or self._unusable(item, block_size, now_s) is not None:
                continue
            blocks = item.record.verified_blocks(prompt)
            if blocks and (
                best is None
                or blocks > best[1]
                or (
                    blocks == best[1]
                    and item.entry.register_time.ToNanoseconds() > best[0].entry.register_time.ToNanoseconds()
                )
            ):
                best = (item, blocks)
        return best

    # ------------------------------------------------------------------ operator reads / deletes

    async def get_entry(self, principal: Principal, key: registry_pb2.EntryKey) -> registry_pb2.Entry:
        v.check_entry_key("key", key)
        tenant = principal.tenant_for(key.tenant, field="key.tenant")
        kv = await self._store.get(self._keys.entry(tenant, key.model, key.conversation_key), timeout=self._timeout)
        if kv is None:
            raise NotFound(Reason.ENTRY_NOT_FOUND, "no entry for this key")
        return registry_pb2.Entry.FromString(kv.value)

    async def delete_entry(
        self,
        principal: Principal,
        key: registry_pb2.EntryKey,
        reason: types_pb2.RevokeReason.ValueType,
        *,
        expected_epoch: int = 0,
    ) -> registry_pb2.Entry:
        """Deletes the conversation's entry (``expected_epoch`` nonzero: only if it has that epoch, in the same
        compare-and-delete, so of several callers that saw the entry exactly one deletes it)."""
        v.check_entry_key("key", key)
        if reason not in types_pb2.RevokeReason.values():
            raise invalid_field("reason", "unknown revoke reason")
        tenant = principal.tenant_for(key.tenant, field="key.tenant")
        store_key = self._keys.entry(tenant, key.model, key.conversation_key)
        for _ in range(_CAS_ATTEMPTS):
            kv = await self._store.get(store_key, timeout=self._timeout)
            if kv is None:
                raise NotFound(Reason.ENTRY_NOT_FOUND, "no entry for this key")
            entry = registry_pb2.Entry.FromString(kv.value)
            if expected_epoch and entry.epoch != expected_epoch:
                raise FailedPrecondition(
                    Reason.STALE_EPOCH,
                    f"stored epoch {entry.epoch} is not the expected {expected_epoch}",
                    metadata={"field": "expected_epoch", "stored_epoch": str(entry.epoch)},
                )
            result = await self._store.txn(
                [Compare.mod_revision_is(store_key, kv.mod_revision)], [Delete(store_key)], timeout=self._timeout
            )
            if result.succeeded:
                self.index.delete_entry((tenant, key.model, key.conversation_key), result.revision)
                self._revoker.submit(entry.lease_id, reason or types_pb2.REVOKE_REASON_OPERATOR)
                return entry
        raise Aborted(Reason.OVERLOADED, "too much contention on this conversation; retry")

    async def list_entries(
        self, principal: Principal, request: registry_pb2.ListEntriesRequest
    ) -> registry_pb2.ListEntriesResponse:
        v.check_tenant_field("tenant", request.tenant)
        tenant = principal.tenant_for(request.tenant)
        if request.model:
            v.check_model("model", request.model)
        if request.engine_id:
            v.check_id("engine_id", request.engine_id)
        size = v.page_size("page_size", request.page_size)
        prefix = self._keys.entries_prefix(tenant, request.model or None)
        query = prefix + b"\x00" + request.engine_id.encode()
        after = _decode_page_token(request.page_token, query) if request.page_token else None
        out: list[registry_pb2.Entry] = []
        last_key: bytes | None = None
        more = True
        # Bounded scan: a filtered page may come back short, with a token to go on.
        for _ in range(8):
            kvs, _rev = await self._store.range_prefix(
                prefix, start_after=after, limit=size + 1 - len(out), timeout=self._timeout
            )
            more = len(kvs) > size - len(out)
            for kv in kvs[: size - len(out)]:
                last_key = kv.key
                entry = registry_pb2.Entry.FromString(kv.value)
                if not request.engine_id or entry.engine_id == request.engine_id:
                    out.append(entry)
            after = last_key
            if len(out) >= size or not more:
                break
        token = _encode_page_token(query, last_key) if more and last_key is not None else ""
        return registry_pb2.ListEntriesResponse(entries=out, next_page_token=token)


def _check_entry_lease(lease: lease_pb2.Lease, entry: registry_pb2.Entry) -> None:
    key = entry.key
    mismatch = (
        lease.kind == lease_pb2.LEASE_KIND_NODE
        or lease.tenant != key.tenant
        or lease.engine_id != entry.engine_id
        or (lease.model and lease.model != key.model)
        or (lease.conversation_key and lease.conversation_key != key.conversation_key)
    )
    if mismatch:
        raise FailedPrecondition(
            Reason.LEASE_MISMATCH,
            "the lease belongs to another engine, tenant or conversation",
            metadata={"field": "entry.lease_id"},
        )


def _replay(record_kv: KeyValue, digest: bytes, request_id: str) -> registry_pb2.RegisterEntryResponse:
    raw = record_kv.value
    if raw[:1] != _RECORD_VERSION or raw[1:33] != digest:
        raise FailedPrecondition(
            Reason.IDEMPOTENCY_CONFLICT,
            f"request id {request_id!r} was used for a different registration",
            metadata={"field": "request_id"},
        )
    response = registry_pb2.RegisterEntryResponse.FromString(raw[33:])
    response.replayed = True
    return response


def _encode_page_token(query: bytes, last_key: bytes) -> str:
    tag = hashlib.sha256(query).digest()[:8]
    return base64.urlsafe_b64encode(tag + last_key).decode()


def _decode_page_token(token: str, query: bytes) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raw = b""
    if len(token) > 2048 or len(raw) < 9 or raw[:8] != hashlib.sha256(query).digest()[:8]:
        raise InvalidArgument(
            Reason.INVALID_PAGE_TOKEN, "malformed page token or not of this query", metadata={"field": "page_token"}
        )
    return raw[8:]
