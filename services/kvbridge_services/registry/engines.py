"""Engine records: registration under a node lease, new incarnations (and dropping the previous one's
entries), the sweep of engines whose node lease ended, and reads from the index."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from kvbridge import ids
from kvbridge.errors import NotFound, Reason, ResourceExhausted
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common import validation as cv
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.store.base import Compare, Delete, LeaseNotFound, Put

from . import validation as v
from .cas import exists
from .evictions import EntryEvictor
from .leases import check_node_lease, lease_gone, parse_lease
from .page_tokens import decode_page_token, encode_page_token
from .parts import RegistryParts
from .records import now_ts

log = logging.getLogger(__name__)


def engines_query(request: registry_pb2.ListEnginesRequest) -> bytes:
    """What a ListEngines page token is bound to: the list and its filters (a token of one filter is refused
    with another, as ListEntries' tokens are)."""
    return b"engines\x00" + request.model.encode() + b"\x00" + str(request.role).encode()


def list_engines(
    engines: Iterable[types_pb2.Engine], request: registry_pb2.ListEnginesRequest
) -> registry_pb2.ListEnginesResponse:
    """One page of ``engines`` matching the request's filters, by engine id."""
    if request.model:
        ids.MODEL.check("model", request.model)
    size = cv.page_size("page_size", request.page_size, default=v.DEFAULT_PAGE_SIZE, maximum=v.MAX_PAGE_SIZE)
    query = engines_query(request)
    after = decode_page_token(request.page_token, query).decode() if request.page_token else ""
    matching = sorted(
        (
            e
            for e in engines
            if (not request.model or e.model == request.model)
            and (not request.role or e.role == request.role)
            and e.engine_id > after
        ),
        key=lambda e: e.engine_id,
    )
    page = matching[:size]
    token = encode_page_token(query, page[-1].engine_id.encode()) if len(matching) > size else ""
    return registry_pb2.ListEnginesResponse(engines=page, next_page_token=token)


class Engines:
    def __init__(self, parts: RegistryParts, evictor: EntryEvictor, *, max_engines: int) -> None:
        self._parts = parts
        self._evictor = evictor
        self._max_engines = max_engines
        self._background: set[asyncio.Task[object]] = set()

    async def register_engine(self, principal: Principal, engine: types_pb2.Engine) -> types_pb2.Engine:
        v.check_engine(engine, self._parts.limits)
        if engine.engine_id not in self._parts.index.engines and len(self._parts.index.engines) >= self._max_engines:
            raise ResourceExhausted(Reason.BUDGET_EXCEEDED, f"at most {self._max_engines} engines")
        lease_key = self._parts.keys.lease(engine.node_lease_id)
        lease_kv = await self._parts.store.get(lease_key, timeout=self._parts.timeout_s)
        check_node_lease(parse_lease(lease_kv, "engine.node_lease_id"), engine.engine_id)
        stored = types_pb2.Engine()
        stored.CopyFrom(engine)
        stored.registered_at.CopyFrom(now_ts(self._parts.clock))
        key = self._parts.keys.engine(engine.engine_id)
        assert lease_kv is not None
        try:
            result = await self._parts.store.txn(
                [exists(lease_key)],
                [Put(key, stored.SerializeToString(), lease=lease_kv.lease)],
                timeout=self._parts.timeout_s,
            )
        except LeaseNotFound:
            raise lease_gone("engine.node_lease_id") from None
        if not result.succeeded:
            raise lease_gone("engine.node_lease_id")
        self._parts.index.put_engine(stored, result.revision)
        previous = self._parts.index.of_other_incarnations(stored)
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

    async def close(self) -> None:
        """Cancels the background drops still running."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def drop_other_incarnations(self, engine_id: str) -> int:
        """Deletes the indexed entries of ``engine_id`` made by another incarnation than the one registered in
        the store now (a previous process under the same id), revoking their leases (ENGINE_GONE).

        Each delete is conditional on the engine record being the one read here, so an index that lags the
        store (an engine re-registered since) never deletes the current incarnation's entries.
        """
        engine_key = self._parts.keys.engine(engine_id)
        kv = await self._parts.store.get(engine_key, timeout=self._parts.timeout_s)
        if kv is None:
            return 0  # deregistered: lookups answer ENGINE_GONE; the node lease's end revokes the leases
        current = types_pb2.Engine.FromString(kv.value)
        dropped = 0
        for item in self._parts.index.of_other_incarnations(current):
            if await self._evictor.delete_indexed(
                item, types_pb2.REVOKE_REASON_ENGINE_GONE, Compare.mod_revision_is(engine_key, kv.mod_revision)
            ):
                dropped += 1
        return dropped

    async def deregister_engine(self, principal: Principal, engine_id: str) -> None:
        ids.ENGINE_ID.check("engine_id", engine_id)
        if not await self._parts.store.delete(self._parts.keys.engine(engine_id), timeout=self._parts.timeout_s):
            raise NotFound(Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered")
        self._parts.index.delete_engine(
            engine_id, await self._parts.store.current_revision(timeout=self._parts.timeout_s)
        )

    async def sweep_engines(self) -> int:
        """Deregister engines whose node lease record is gone (the lease manager ended it).

        Node leases live in the lease manager's table (docs/adr/0002), not in store
        leases, so the engine record is not deleted by the store on expiry; this sweep
        makes "registered" mean "live" within one sweep interval. Idempotent across replicas.
        """
        removed = 0
        for engine in list(self._parts.index.engines.values()):
            lease_key = self._parts.keys.lease(engine.node_lease_id)
            if await self._parts.store.get(lease_key, timeout=self._parts.timeout_s) is not None:
                continue
            key = self._parts.keys.engine(engine.engine_id)
            current = await self._parts.store.get(key, timeout=self._parts.timeout_s)
            if current is None or types_pb2.Engine.FromString(current.value).node_lease_id != engine.node_lease_id:
                continue
            result = await self._parts.store.txn(
                [Compare.mod_revision_is(key, current.mod_revision), Compare.absent(lease_key)],
                [Delete(key)],
                timeout=self._parts.timeout_s,
            )
            if result.succeeded:
                self._parts.index.delete_engine(engine.engine_id, result.revision)
                log.info("engine %s deregistered: node lease %d ended", engine.engine_id, engine.node_lease_id)
                removed += 1
        for engine_id in list(self._parts.index.suspect_engines):
            self._parts.index.suspect_engines.discard(engine_id)
            await self.drop_other_incarnations(engine_id)
            now = self._parts.index.engines.get(engine_id)
            if now is not None and self._parts.index.of_other_incarnations(now):
                self._parts.index.suspect_engines.add(engine_id)  # a delete lost a race: the next sweep tries again
        return removed

    def get_engine(self, engine_id: str) -> types_pb2.Engine:
        ids.ENGINE_ID.check("engine_id", engine_id)
        engine = self._parts.index.engines.get(engine_id)
        if engine is None:
            raise NotFound(Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered")
        return engine

    def list_engines(self, request: registry_pb2.ListEnginesRequest) -> registry_pb2.ListEnginesResponse:
        return list_engines(self._parts.index.engines.values(), request)
