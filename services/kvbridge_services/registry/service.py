"""gRPC servicer of kvbridge.registry.v1.RegistryService: authenticate, delegate, translate errors."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge import ids
from kvbridge import telemetry as tel
from kvbridge.errors import FailedPrecondition, KvbridgeError, Reason, invalid_field
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge_services.common import validation as cv
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.authz import caller
from kvbridge_services.common.boundary import rpc_boundary, stream_boundary
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Compacted, EventType, Store
from kvbridge_services.common.telemetry import Telemetry

from .core import Registry
from .index import RegistryIndex

Ctx = grpc.aio.ServicerContext[Any, Any]
_MAX_PROGRESS_S = 300.0
_DEFAULT_PROGRESS_S = 10.0
_SNAPSHOT_PAGE = 500  # entries per snapshot message
_ENTRY_BYTES_MAX_AGE_S = 10.0  # summing every entry's size is O(entries): at most this often


class _IndexCollector(Collector):
    """Index size at scrape time (scrapes run on the metrics thread: read-only, copying before iterating)."""

    def __init__(self, index: RegistryIndex) -> None:
        self._index = index
        self._bytes = 0
        self._bytes_at = float("-inf")

    def _entry_bytes(self) -> int:
        if time.monotonic() - self._bytes_at >= _ENTRY_BYTES_MAX_AGE_S:
            try:
                items = list(self._index.entries.values())
            except RuntimeError:  # resized under us by the event loop: keep the last figure
                return self._bytes
            self._bytes = sum(item.entry.ByteSize() for item in items)
            self._bytes_at = time.monotonic()
        return self._bytes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "kvbridge_registry_entries", "Entries in the in-memory index", value=len(self._index.entries)
        )
        yield GaugeMetricFamily(
            "kvbridge_registry_entry_bytes",
            "Serialized size of the indexed entries (refreshed at most every 10 s)",
            value=self._entry_bytes(),
        )
        yield GaugeMetricFamily(
            "kvbridge_registry_engines", "Registered engines in the index", value=len(self._index.engines)
        )
        lag = self._index.lag_s()
        yield GaugeMetricFamily(
            "kvbridge_registry_index_lag_seconds",
            "Seconds since the index last heard from the store (watch event or progress; "
            "-1: never); lookups answer INDEX_STALE past the bound",
            value=-1.0 if lag == float("inf") else lag,
        )
        yield GaugeMetricFamily(
            "kvbridge_registry_index_max_lag_seconds",
            "The index's freshness bound (KVBRIDGE_REGISTRY_INDEX_MAX_LAG_S)",
            value=self._index.max_lag_s,
        )


class _EvictionCollector(Collector):
    """Entries the registry removed itself, by reason (``Registry.evictions``): a recorded eviction, not a loss."""

    def __init__(self, evictions: Mapping[str, int]) -> None:
        self._evictions = evictions

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvbridge_registry_entries_evicted",
            "Entries the registry evicted (tenant_cap: the tenant reached "
            "KVBRIDGE_REGISTRY_MAX_ENTRIES_PER_TENANT; its oldest-idle entry removed, "
            "its lease revoked)",
            labels=["reason"],
        )
        for reason, count in dict(self._evictions).items():
            family.add_metric([reason], count)
        yield family


class RegistryMetrics:
    def __init__(
        self, registry: CollectorRegistry, index: RegistryIndex, evictions: Mapping[str, int] | None = None
    ) -> None:
        self.lookups = Counter(
            "kvbridge_registry_lookups_total", "LookupEntry answers by verdict", ["verdict"], registry=registry
        )
        self.lookup_verified_tokens = Counter(
            "kvbridge_registry_lookup_verified_tokens_total",
            "Tokens verified by LookupEntry answers",
            registry=registry,
        )
        self.registrations = Counter(
            "kvbridge_registry_registrations_total",
            "RegisterEntry outcomes (ok, replayed, superseded, or the error reason)",
            ["outcome"],
            registry=registry,
        )
        registry.register(_IndexCollector(index))
        registry.register(_EvictionCollector(evictions if evictions is not None else {}))
        # Per-verdict children and names resolved once: labels() and enum lookups cost µs on the lookup path.
        self._by_verdict: dict[int, tuple[str, Any]] = {}

    def count_lookup(self, verdict: int, verified_tokens: int) -> str:
        """Counts one answer; returns the verdict's short name."""
        known = self._by_verdict.get(verdict)
        if known is None:
            name = _verdict_name(verdict)
            known = self._by_verdict[verdict] = (name, self.lookups.labels(name))
        known[1].inc()
        if verified_tokens:
            self.lookup_verified_tokens.inc(verified_tokens)
        return known[0]


def _verdict_name(verdict: int) -> str:
    return registry_pb2.LookupVerdict.Name(verdict).removeprefix("LOOKUP_VERDICT_").lower()  # type: ignore[arg-type]


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(
        self,
        registry: Registry,
        auth: Authenticator,
        store: Store,
        keys: KeyLayout,
        *,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._registry = registry
        self._auth = auth
        self._store = store
        self._keys = keys
        self._telemetry = telemetry or Telemetry.disabled("kvbridge-registry")
        self.metrics = RegistryMetrics(self._telemetry.registry, registry.index, registry.evictions)

    def _annotate(self, tenant: str, model: str, conversation_key: str) -> trace.Span:
        """The RPC's server span (from the interceptor), tagged with the hashed identity."""
        span = trace.get_current_span()
        if span.is_recording():  # the identity HMACs cost a few µs per RPC: only when a span keeps them
            span.set_attributes(
                {tel.ATTR_MODEL: model, **self._telemetry.identity(tenant=tenant, conversation_key=conversation_key)}
            )
        return span

    @rpc_boundary
    async def RegisterEngine(
        self, request: registry_pb2.RegisterEngineRequest, context: Ctx
    ) -> registry_pb2.RegisterEngineResponse:
        principal = caller()
        if not request.HasField("engine"):
            raise invalid_field("engine", "required")
        engine = await self._registry.engines.register_engine(principal, request.engine)
        return registry_pb2.RegisterEngineResponse(engine=engine)

    @rpc_boundary
    async def DeregisterEngine(
        self, request: registry_pb2.DeregisterEngineRequest, context: Ctx
    ) -> registry_pb2.DeregisterEngineResponse:
        await self._registry.engines.deregister_engine(caller(), request.engine_id)
        return registry_pb2.DeregisterEngineResponse()

    @rpc_boundary
    async def GetEngine(self, request: registry_pb2.GetEngineRequest, context: Ctx) -> registry_pb2.GetEngineResponse:
        caller()
        return registry_pb2.GetEngineResponse(engine=self._registry.engines.get_engine(request.engine_id))

    @rpc_boundary
    async def ListEngines(
        self, request: registry_pb2.ListEnginesRequest, context: Ctx
    ) -> registry_pb2.ListEnginesResponse:
        caller()
        return self._registry.engines.list_engines(request)

    @rpc_boundary
    async def RegisterEntry(
        self, request: registry_pb2.RegisterEntryRequest, context: Ctx
    ) -> registry_pb2.RegisterEntryResponse:
        key = request.entry.key
        span = self._annotate(key.tenant, key.model, key.conversation_key)
        if span.is_recording():
            span.set_attributes(
                {
                    tel.ATTR_ENGINE: request.entry.engine_id,
                    "kvbridge.entry.epoch": request.entry.epoch,
                    "kvbridge.entry.tokens": request.entry.token_count,
                }
            )
        try:
            response = await self._registry.registrar.register_entry(caller(), request)
        except KvbridgeError as err:
            self.metrics.registrations.labels((err.reason or err.code.name).lower()).inc()
            raise
        outcome = "replayed" if response.replayed else "superseded" if response.superseded_epoch else "ok"
        self.metrics.registrations.labels(outcome).inc()
        return response

    @rpc_boundary
    async def LookupEntry(
        self, request: registry_pb2.LookupEntryRequest, context: Ctx
    ) -> registry_pb2.LookupEntryResponse:
        span = self._annotate(request.tenant, request.model, request.conversation_key)
        response = self._registry.lookups.lookup(caller(), request)
        verdict = self.metrics.count_lookup(response.verdict, response.verified_tokens)
        if span.is_recording():
            span.set_attributes({tel.ATTR_VERDICT: verdict, tel.ATTR_VERIFIED_TOKENS: response.verified_tokens})
            if response.HasField("location"):
                span.set_attribute(tel.ATTR_ENGINE, response.location.engine.engine_id)
        return response

    @rpc_boundary
    async def GetEntry(self, request: registry_pb2.GetEntryRequest, context: Ctx) -> registry_pb2.GetEntryResponse:
        entry = await self._registry.entries.get_entry(caller(), request.key)
        return registry_pb2.GetEntryResponse(entry=entry)

    @rpc_boundary
    async def ListEntries(
        self, request: registry_pb2.ListEntriesRequest, context: Ctx
    ) -> registry_pb2.ListEntriesResponse:
        return await self._registry.entries.list_entries(caller(), request)

    @rpc_boundary
    async def DeleteEntry(
        self, request: registry_pb2.DeleteEntryRequest, context: Ctx
    ) -> registry_pb2.DeleteEntryResponse:
        entry = await self._registry.entries.delete_entry(
            caller(), request.key, request.reason, expected_epoch=request.expected_epoch
        )
        return registry_pb2.DeleteEntryResponse(entry=entry)

    @stream_boundary
    async def WatchEntries(
        self, request: registry_pb2.WatchEntriesRequest, context: Ctx
    ) -> AsyncIterator[registry_pb2.WatchEntriesResponse]:
        principal = caller()
        ids.TENANT.check_optional("tenant", request.tenant)
        # Empty tenant: a non-tenant principal watches every tenant, a tenant principal its own (as in other RPCs).
        tenant: str | None = (
            principal.tenant_for(request.tenant) if request.tenant or principal.tenant is not None else None
        )
        if request.engine_id:
            ids.ENGINE_ID.check("engine_id", request.engine_id)
        if request.start_revision < 0:
            raise invalid_field("start_revision", "must be >= 0")
        progress = cv.duration_s("progress_interval", request.progress_interval) or _DEFAULT_PROGRESS_S
        if not 0 < progress <= _MAX_PROGRESS_S:
            raise invalid_field("progress_interval", f"must be in (0, {_MAX_PROGRESS_S:.0f}s]")
        prefix = self._keys.entries_prefix(tenant)

        def wanted(entry: registry_pb2.Entry) -> bool:
            return not request.engine_id or entry.engine_id == request.engine_id

        start = request.start_revision
        if start == 0:
            # One message per page, so a large snapshot never exceeds a message size limit; later pages may be
            # read at later revisions, which the watch from the first page's revision on then replays
            # (watchers keep the higher mod_revision of each entry).
            after: bytes | None = None
            while True:
                kvs, revision = await self._store.range_prefix(prefix, start_after=after, limit=_SNAPSHOT_PAGE)
                start = start or revision
                page = registry_pb2.WatchEntriesResponse(revision=start, snapshot_complete=len(kvs) < _SNAPSHOT_PAGE)
                page.as_of.GetCurrentTime()  # the read answered now: what the page holds is this old
                for kv in kvs:
                    entry = registry_pb2.Entry.FromString(kv.value)
                    if wanted(entry):
                        page.events.add(type=registry_pb2.EntryEvent.TYPE_PUT, entry=entry, revision=kv.mod_revision)
                if page.events or page.snapshot_complete:
                    yield page
                if page.snapshot_complete:
                    break
                after = kvs[-1].key
            start += 1
        try:
            async for batch in self._store.watch_prefix(prefix, start_revision=start, progress_interval_s=progress):
                out = registry_pb2.WatchEntriesResponse(revision=batch.revision)
                out.as_of.GetCurrentTime()  # the store's watch delivered the batch now
                for event in batch.events:
                    if event.type is EventType.PUT:
                        entry = registry_pb2.Entry.FromString(event.kv.value)
                        kind = registry_pb2.EntryEvent.TYPE_PUT
                    else:
                        entry = _deleted_entry(self._keys, event.kv.key, event.prev_kv)
                        kind = registry_pb2.EntryEvent.TYPE_DELETE
                    if wanted(entry):
                        out.events.add(type=kind, entry=entry, revision=event.kv.mod_revision)
                if out.events or not batch.events:
                    yield out
        except Compacted as exc:
            raise FailedPrecondition(
                Reason.INVALID_FIELD,
                f"start_revision is compacted; restart from {exc.compact_revision} or 0 for a snapshot",
                metadata={"field": "start_revision", "compact_revision": str(exc.compact_revision)},
            ) from None


def _deleted_entry(keys: KeyLayout, key: bytes, prev: object) -> registry_pb2.Entry:
    value = getattr(prev, "value", b"")
    if value:
        return registry_pb2.Entry.FromString(value)
    tenant, model, conv = keys.parse_entry(key)
    return registry_pb2.Entry(key=registry_pb2.EntryKey(tenant=tenant, model=model, conversation_key=conv))
