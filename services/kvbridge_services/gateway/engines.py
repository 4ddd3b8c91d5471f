"""Prefill and decode engine pools: static config + registry, health checks, load-aware choice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from kvbridge.errors import Reason, Unavailable
from kvbridge.types.v1 import types_pb2

from .upstream import TRANSPORT_ERRORS, EngineHttp, connection_refused

log = logging.getLogger(__name__)

# An engine marked down is re-probed on demand at most this often.
_REPROBE_AFTER_S = 0.5
# Outlier ejection: an engine that timed out gets no new traffic for EJECT_BASE_S, doubling per
# consecutive timeout up to EJECT_MAX_S. A hung engine usually still answers /health, so health
# checks alone would keep sending it turns.
EJECT_BASE_S = 5.0
EJECT_MAX_S = 120.0

PREFILL, DECODE = "prefill", "decode"
_KV_USAGE = re.compile(r"^vllm:(?:gpu_)?kv_cache_usage_perc(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.MULTILINE)
MAX_ENGINES = 4096  # cap of the pool table


@dataclass(slots=True)
class EngineState:
    url: str
    role: str  # PREFILL | DECODE
    model: str = ""  # "" = serves whatever it lists in /v1/models (learned by the health check)
    engine_id: str = ""
    record: types_pb2.Engine | None = None  # the registry's record, when known
    source: str = "static"  # "static" | "registry"
    healthy: bool = False
    outstanding: int = 0
    # Of those, local prefills (placement's plain requests to a decode engine), until D's response (non-streaming:
    # the whole call, decode included) or its response headers (streaming).
    prefilling: int = 0
    kv_usage: float = 0.0
    models: set[str] = field(default_factory=set)
    adapters: set[str] = field(default_factory=set)  # served names /v1/models lists with a parent (LoRA adapters)
    last_check: float = 0.0
    ejected_until: float = 0.0  # monotonic; no new traffic before it unless nothing else is left
    consecutive_timeouts: int = 0
    # A stock engine this gateway registers (compatibility mode). A restarted vLLM keeps its id and URL but not
    # its blocks, and nothing else tells the registry: so once a health check could not connect, its entries
    # may name a previous process's blocks, and no turn pulls from it until the gateway registered it again under
    # a new node lease (a new incarnation, which retires every older entry).
    gateway_registered: bool = False
    needs_new_incarnation: bool = False
    # A stock engine this gateway is to register but has not (yet, or ever: its registration failed): routed, but
    # nothing it retains is registered, since its block size and NIXL identity are not known (ADR 0027).
    pending_registration: bool = False
    # Its NIXL identity was stated by the engine (a probe), not configured: a restarted vLLM may state another.
    identity_probed: bool = False

    @property
    def offers_blocks(self) -> bool:
        """Whether P may pull from this engine now: healthy and not waiting for a new incarnation."""
        return self.healthy and not self.needs_new_incarnation

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.url)

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.models


def _role_names(role: int) -> tuple[str, ...]:
    if role == types_pb2.ENGINE_ROLE_PREFILL:
        return (PREFILL,)
    if role == types_pb2.ENGINE_ROLE_DECODE:
        return (DECODE,)
    if role == types_pb2.ENGINE_ROLE_BOTH:
        return (PREFILL, DECODE)
    return ()


class EnginePool:
    def __init__(self, http: EngineHttp, *, health_timeout_s: float, kv_usage_weight: float) -> None:
        self._http = http
        self._engines: dict[tuple[str, str], EngineState] = {}
        self._health_timeout_s = health_timeout_s
        self._kv_usage_weight = kv_usage_weight

    # -- membership --------------------------------------------------------------------
    def add_static(self, url: str, role: str, *, model: str = "", engine_id: str = "") -> EngineState:
        state = EngineState(url=url, role=role, model=model, engine_id=engine_id)
        self._engines.setdefault(state.key, state)
        return self._engines[state.key]

    def sync_registry(self, records: Iterable[types_pb2.Engine]) -> None:
        """Replaces the registry-sourced members with ``records`` (live engines with an HTTP URL)."""
        seen: set[tuple[str, str]] = set()
        for rec in records:
            if not rec.http_url:
                continue
            for role in _role_names(rec.role):
                key = (role, rec.http_url.rstrip("/"))
                seen.add(key)
                state = self._engines.get(key)
                if state is None:
                    if len(self._engines) >= MAX_ENGINES:
                        log.warning("engine pool full (%d); ignoring %s", MAX_ENGINES, rec.engine_id)
                        continue
                    state = EngineState(url=key[1], role=role, source="registry")
                    self._engines[key] = state
                state.record = rec
                state.engine_id = rec.engine_id
                state.model = state.model or rec.model
        for key in [k for k, s in self._engines.items() if s.source == "registry" and k not in seen]:
            del self._engines[key]

    def all(self) -> list[EngineState]:
        return list(self._engines.values())

    def models(self) -> set[str]:
        out: set[str] = set()
        for s in self._engines.values():
            if s.model:
                out.add(s.model)
            out |= s.models
        return out

    def find(self, engine_id: str) -> EngineState | None:
        for s in self._engines.values():
            if s.engine_id == engine_id:
                return s
        return None

    def find_role(self, engine_id: str, role: str) -> EngineState | None:
        """The engine ``engine_id`` as a member of the ``role`` pool (an engine of role both is in two)."""
        for s in self._engines.values():
            if s.engine_id == engine_id and s.role == role:
                return s
        return None

    def load(self, engine: EngineState) -> float:
        """The load score the choice minimises: outstanding requests plus weighted KV usage."""
        return engine.outstanding + self._kv_usage_weight * engine.kv_usage

    def count(self, model: str, role: str) -> int:
        return sum(1 for s in self._engines.values() if s.role == role and s.serves(model) and s.healthy)

    # -- choice ------------------------------------------------------------------------
    def choose(self, model: str, role: str, *, exclude: frozenset[str] = frozenset()) -> EngineState:
        """The least loaded healthy engine of ``role`` serving ``model``, skipping ejected ones while any
        other is left (ejecting every engine would turn slowness into an outage)."""
        candidates = [
            s
            for s in self._engines.values()
            if s.role == role and s.healthy and s.serves(model) and s.url not in exclude
        ]
        if not candidates:
            raise Unavailable(Reason.NO_ENGINE_AVAILABLE, f"no healthy {role} engine serves model {model!r}")
        now = time.monotonic()
        serving = [s for s in candidates if not s.ejected(now)]
        if not serving:
            return min(candidates, key=lambda s: (s.ejected_until, s.url))  # the one back soonest
        return min(serving, key=lambda s: (self.load(s), s.url))

    def timed_out(self, engine: EngineState) -> None:
        """Ejects an engine that missed a deadline, for longer each time in a row."""
        engine.consecutive_timeouts += 1
        period = min(EJECT_BASE_S * 2 ** (engine.consecutive_timeouts - 1), EJECT_MAX_S)
        engine.ejected_until = time.monotonic() + period
        log.warning(
            "engine %s (%s) timed out %d time(s) in a row: no new traffic for %.0fs",
            engine.url,
            engine.role,
            engine.consecutive_timeouts,
            period,
        )

    def answered(self, engine: EngineState) -> None:
        """A call completed within its deadline: the engine's timeout streak ends."""
        engine.consecutive_timeouts = 0

    async def choose_live(self, model: str, role: str, *, exclude: frozenset[str] = frozenset()) -> EngineState:
        """``choose``, but when every candidate is marked down, probe them once now before answering 503:
        a missed periodic check (a stalled host, a restart) should cost one probe, not the request."""
        try:
            return self.choose(model, role, exclude=exclude)
        except Unavailable:
            stale = [
                s
                for s in self._engines.values()
                if s.role == role
                and not s.healthy
                and s.url not in exclude
                and (not s.model or s.serves(model))
                and time.monotonic() - s.last_check > _REPROBE_AFTER_S
            ]
            if not stale:
                raise
            await asyncio.gather(*(self.check(s) for s in stale))
            return self.choose(model, role, exclude=exclude)

    @contextlib.asynccontextmanager
    async def using(self, engine: EngineState) -> AsyncIterator[EngineState]:
        engine.outstanding += 1
        try:
            yield engine
        finally:
            engine.outstanding -= 1

    def mark_failed(self, engine: EngineState, why: str) -> None:
        """Passive health: a transport failure takes the engine out until its next good check."""
        if engine.healthy:
            log.warning("engine %s (%s) marked unhealthy: %s", engine.url, engine.role, why)
        engine.healthy = False

    @staticmethod
    def _seen_gone(engine: EngineState) -> None:
        if engine.gateway_registered and not engine.needs_new_incarnation:
            engine.needs_new_incarnation = True
            log.info(
                "engine %s (%s) refused the connection: maybe a new process next; no pulls from it until it is "
                "registered again",
                engine.url,
                engine.role,
            )

    # -- health --------------------------------------------------------------------------
    async def check(self, engine: EngineState) -> None:
        """Health is vLLM's /health alone; models and KV usage are best-effort extras that a slow
        /metrics (common on a loaded CPU host) must not turn into an outage."""
        timeout = self._health_timeout_s
        try:
            resp = await self._http.get(f"{engine.url}/health", timeout_s=timeout)
            healthy = resp.status == 200
        except TRANSPORT_ERRORS as exc:
            healthy = False
            log.debug("health check of %s failed: %s", engine.url, exc)
            if connection_refused(exc):
                # No connection: the process may be gone, and a restarted one has other blocks. A restart always
                # shows here first: vLLM refuses connections for 45 s or more while it starts. A timeout or an error
                # status is a live (slow, sick) process: its blocks are its own.
                self._seen_gone(engine)
        if healthy:
            await self._refresh_load_info(engine, timeout)
        if healthy != engine.healthy:
            log.info("engine %s (%s) is now %s", engine.url, engine.role, "healthy" if healthy else "UNHEALTHY")
        engine.healthy = healthy
        engine.last_check = time.monotonic()

    async def _refresh_load_info(self, engine: EngineState, timeout: float) -> None:
        try:
            if not engine.models:
                models = await self._http.get(f"{engine.url}/v1/models", timeout_s=timeout)
                if models.status == 200:
                    cards = [m for m in models.json().get("data", [])[:64] if isinstance(m, dict)]
                    engine.adapters = {
                        str(m.get("id")) for m in cards if m.get("parent") and m.get("parent") != m.get("id")
                    }
                    engine.models = {str(m.get("id")) for m in cards}
            metrics = await self._http.get(f"{engine.url}/metrics", timeout_s=timeout)
            if metrics.status == 200:
                match = _KV_USAGE.search(metrics.text)
                if match:
                    engine.kv_usage = min(1.0, max(0.0, float(match.group(1))))
        except TRANSPORT_ERRORS as exc:
            log.debug("load info of %s unavailable: %s", engine.url, exc)
        except ValueError as exc:
            log.debug("load info of %s unreadable: %s", engine.url, exc)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.all()))
