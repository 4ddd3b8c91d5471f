"""Engines given by URL (``prefill_engines`` / ``decode_engines``): the gateway registers each stock engine in the
registry under a node lease it keeps alive (compatibility mode), with what the engine itself states for whatever the
configuration leaves out (discovery.py, ADR 0027).

At start every engine to register is asked first; one that answers without a field the gateway needs fails the start
(:class:`StaticEngineError`, one line naming the fields and the fix) before anything is registered. One that does not
answer yet (vLLM takes minutes to start) is routed once healthy but registered only once it answers: until then, or for
good if it then states too little (logged at ERROR once), nothing it retains is registered and the metric
``kvbridge_gateway_static_engine_registered{role,url}`` is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.lease.v1 import lease_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.metric_factory import MetricFactory

from . import reuse
from .config import GatewaySettings, StaticEngine
from .control import ControlPlane, ControlPlaneError
from .discovery import Identity, Undiscoverable, Unreachable, discover
from .engines import DECODE, PREFILL, EnginePool, EngineState
from .metrics import engine_label
from .upstream import EngineHttp

log = logging.getLogger(__name__)

NODE_LEASE_TTL_S = 30.0
_ROLES = {PREFILL: types_pb2.ENGINE_ROLE_PREFILL, DECODE: types_pb2.ENGINE_ROLE_DECODE}
_ENV = {PREFILL: "KVBRIDGE_GATEWAY_PREFILL_ENGINES", DECODE: "KVBRIDGE_GATEWAY_DECODE_ENGINES"}


class StaticEngineError(ValueError):
    """An engine given by URL that answered without what its registration needs: the gateway does not start."""


@dataclass(slots=True)
class StaticMember:
    spec: StaticEngine
    role: str  # PREFILL | DECODE
    state: EngineState
    registers: bool  # the gateway registers it (else plain routing, or another replica registers it)
    identity: Identity | None = None
    failed: str = ""  # why its registration was given up (logged once)
    waiting_logged: bool = False
    connector: bool = False  # the registry knows it as a kvbridge connector engine: it registers itself

    @property
    def registered(self) -> bool:
        return self.state.gateway_registered and not self.state.pending_registration


@dataclass(frozen=True, slots=True)
class Route:
    """One engine the gateway routes to, as ``kvbridge up`` prints it."""

    url: str
    role: str
    model: str
    mode: str  # "compatibility" | "connector"
    registered: str  # who registered it, or why nobody did
    healthy: bool

    def line(self) -> str:
        return (
            f"{self.role} {self.url}: model {self.model or '?'}, {self.mode} mode, {self.registered}"
            f"{'' if self.healthy else ' (not healthy yet)'}"
        )


class StaticEngines:
    def __init__(
        self,
        settings: GatewaySettings,
        pool: EnginePool,
        control: ControlPlane,
        http: EngineHttp,
        metrics: MetricFactory,
        *,
        forget_clock: Callable[[str], None],
    ) -> None:
        """``forget_clock(engine_id)``: a new incarnation's clock is learned anew (the router's clock table)."""
        self._settings, self._pool, self._control, self._http = settings, pool, control, http
        self._forget_clock = forget_clock
        self._leases: dict[str, int] = {}  # engine id -> its node lease
        self._round: asyncio.Task[None] | None = None  # the registrations a health round started
        self.members: list[StaticMember] = []
        for role, specs in ((PREFILL, settings.prefill_engines), (DECODE, settings.decode_engines)):
            for spec in specs:
                state = pool.add_static(spec.url, role, model=spec.model, engine_id=spec.engine_id)
                wanted = (
                    settings.register_static_engines if spec.register_in_registry is None else spec.register_in_registry
                )
                member = StaticMember(spec, role, state, registers=wanted and control.enabled)
                state.pending_registration = member.registers
                self.members.append(member)
        self._gauge = metrics.gauge(
            "kvbridge_gateway_static_engine_registered",
            "Engines given by URL that the gateway is to register (compatibility mode): 1 registered, 0 not (yet); "
            "engine: its configured engine id, else url- and a digest of its URL (metrics.engine_label)",
            ["role", "engine"],
        )
        self._update_gauge()

    @property
    def registering(self) -> bool:
        return any(m.registers for m in self.members)

    def _update_gauge(self) -> None:
        for m in self.members:
            if m.registers:
                label = engine_label(m.spec.engine_id, m.spec.url)  # never the URL: /metrics needs no key
                self._gauge.labels(m.role, label).set(1 if m.registered or m.connector else 0)

    # -- start -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Asks every engine to register, then registers those that answered in full. Raises
        :class:`StaticEngineError` (nothing registered) when one answered without a field it needs."""
        todo = [m for m in self.members if m.registers]
        found = await asyncio.gather(*(self._discover(m) for m in todo))
        refused = [str(r) for r in found if isinstance(r, Undiscoverable)]
        if refused:
            more = f" (and {len(refused) - 1} more engine(s) alike)" if len(refused) > 1 else ""
            raise StaticEngineError(refused[0] + more)
        await self._register_found(todo)

    async def _discover(self, member: StaticMember) -> Identity | Undiscoverable | Unreachable:
        try:
            member.identity = await discover(
                self._http,
                member.spec,
                member.role,
                timeout_s=max(self._settings.health_timeout_s, 5.0),
                env=_ENV[member.role],
            )
            return member.identity
        except (Undiscoverable, Unreachable) as exc:
            return exc

    async def _register_found(self, members: Sequence[StaticMember]) -> None:
        ready = [m for m in members if m.identity is not None and not m.connector and not m.registered]
        if not ready:
            self._log_waiting(members)
            return
        connectors = await self._connector_engines()
        for m in ready:
            assert m.identity is not None
            if m.identity.engine_id in connectors:
                self._take_connector(m, connectors[m.identity.engine_id])
            else:
                await self._register(m)
        self._log_waiting(members)

    def _log_waiting(self, members: Sequence[StaticMember]) -> None:
        for m in members:
            if m.registers and m.identity is None and not m.waiting_logged and not m.failed:
                m.waiting_logged = True
                log.warning(
                    "engine %s (%s) does not answer yet: routed once healthy, registered for reuse once it answers",
                    m.spec.url,
                    m.role,
                )
        self._update_gauge()

    async def _connector_engines(self) -> dict[str, types_pb2.Engine]:
        """Engines the registry lists with the kvbridge connector: they register themselves, never the gateway."""
        try:
            records = await self._control.list_engines()
        except ControlPlaneError as exc:
            log.debug("cannot list engines: %s", exc)
            return {}
        return {r.engine_id: r for r in records if reuse.CONNECTOR_CAPABILITY in r.capabilities}

    def _take_connector(self, member: StaticMember, record: types_pb2.Engine) -> None:
        member.connector = True
        state = member.state
        state.record, state.engine_id, state.pending_registration = record, record.engine_id, False
        log.info("engine %s (%s) runs the kvbridge connector: it registers itself", member.spec.url, member.role)

    async def _register(self, member: StaticMember) -> bool:
        """Registers the engine under a new node lease (a new incarnation); True once the registry has it."""
        ident = member.identity
        assert ident is not None
        try:
            lease_id = await self._control.grant_lease(
                kind=lease_pb2.LEASE_KIND_NODE, engine_id=ident.engine_id, ttl_s=NODE_LEASE_TTL_S
            )
            record = types_pb2.Engine(
                engine_id=ident.engine_id,
                role=_ROLES[member.role],
                model=ident.model,
                http_url=member.spec.url,
                kv_host=ident.kv_host,
                kv_port=ident.kv_port,
                dp_size=1,
                tp_size=1,
                pp_size=1,
                dcp_size=1,
                block_size=ident.block_size,
                kv_group_count=1,
                capabilities=["bidirectional_kv_xfer"],
                node_lease_id=lease_id,
            )
            registered = await self._control.register_engine(record)
        except ControlPlaneError as exc:
            log.warning("cannot register engine %s (%s): %s; trying again", member.spec.url, member.role, exc)
            return False
        self._leases[ident.engine_id] = lease_id
        state = member.state
        state.record, state.engine_id = registered, ident.engine_id
        state.model = state.model or ident.model
        state.identity_probed = ident.probed
        state.gateway_registered, state.pending_registration = True, False
        stated = ", ".join(sorted(ident.stated)) or "nothing"
        log.info(
            "registered engine %s (%s) as %s, block size %d, NIXL %s:%d (stated by the engine: %s)",
            member.spec.url,
            member.role,
            ident.engine_id,
            ident.block_size,
            ident.kv_host,
            ident.kv_port,
            stated,
        )
        return True

    # -- every health round ----------------------------------------------------------------------
    def after_health_check(self) -> None:
        """Starts registering healthy engines not registered yet and engines seen restarting, off the health loop
        (a probe may take long on a busy engine); one such round at a time."""
        if self.registering and (self._round is None or self._round.done()):
            self._round = asyncio.create_task(self._registration_round())

    async def close(self) -> None:
        if self._round is not None:
            self._round.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._round

    async def _registration_round(self) -> None:
        try:
            await self._register_due()
        except Exception:
            log.exception("registering the engines given by URL failed; trying again next round")

    async def _register_due(self) -> None:
        """Registers engines that answer for the first time, and engines seen restarting once they answer again."""
        pending = [m for m in self.members if m.registers and not (m.registered or m.connector or m.failed)]
        restarted = [m for m in self.members if m.registered and m.state.needs_new_incarnation and m.state.healthy]
        if pending:
            await self._first_registrations([m for m in pending if m.identity is None and m.state.healthy])
            await self._register_found(pending)  # and those the registry refused before
        for m in restarted:
            await self._new_incarnation(m)
        if pending or restarted:
            self._update_gauge()

    async def _first_registrations(self, unknown: Sequence[StaticMember]) -> None:
        found = await asyncio.gather(*(self._discover(m) for m in unknown))
        for m, result in zip(unknown, found, strict=True):
            if isinstance(result, Undiscoverable):
                m.failed = str(result)
                log.error("%s", result)  # once: the engine is routed without reuse from now on

    async def _new_incarnation(self, member: StaticMember) -> None:
        """A stock engine that refused a health check's connection (maybe restarted) and answers again: registered
        under a new node lease (the registry then refuses every entry of the old one), the old lease revoked, D's
        clock learned anew. A restarted vLLM may state another engine id (vLLM draws one per start): asked again."""
        old = member.identity
        assert old is not None
        if old.probed:
            result = await self._discover(member)
            if isinstance(result, Unreachable):
                member.identity = old
                return  # still flagged: no pulls from it; tried again next round
            if isinstance(result, Undiscoverable):
                member.identity, member.failed = old, str(result)
                member.state.pending_registration = True  # nothing of the new process is registered
                log.error("%s", result)
                return
        new = member.identity
        assert new is not None
        old_lease = self._leases.pop(old.engine_id, 0) if new.engine_id != old.engine_id else 0
        old_lease = old_lease or self._leases.get(new.engine_id, 0)
        if not await self._register(member):
            return  # still flagged; tried again next round
        member.state.needs_new_incarnation = False
        self._forget_clock(old.engine_id)
        self._forget_clock(new.engine_id)
        log.info(
            "engine %s refused connections or changed id and is back: registered as a new incarnation (%s)",
            member.spec.url,
            new.engine_id,
        )
        if old_lease:
            with contextlib.suppress(ControlPlaneError):
                await self._control.revoke_lease(old_lease)

    # -- node leases ---------------------------------------------------------------------------
    async def lease_loop(self) -> None:
        while True:
            await asyncio.sleep(NODE_LEASE_TTL_S / 3)
            if not self._leases:
                continue
            try:
                statuses = await self._control.keep_alive(lease_ids=list(self._leases.values()))
            except ControlPlaneError as exc:
                log.warning("node lease renewal failed: %s", exc)
                continue
            except Exception:
                log.exception("node lease renewal failed")
                continue
            if any(not st.alive for st in statuses):
                log.warning("a static engine's node lease ended; registering again")
                self._leases.clear()
                for m in self.members:
                    if m.registered and m.identity is not None:
                        await self._register(m)
                self._update_gauge()


def routes(pool: EnginePool, members: Sequence[StaticMember]) -> list[Route]:
    """What the gateway routes to: every engine given by URL, then every engine found in the registry."""
    out: list[Route] = []
    by_state = {id(m.state): m for m in members}
    for state in pool.all():
        member = by_state.get(id(state))
        record = state.record
        connector = record is not None and reuse.CONNECTOR_CAPABILITY in record.capabilities
        if member is None:
            registered = "registered by its connector" if connector else "registered by another gateway"
        elif member.connector:
            registered = "registered by its connector"
        elif member.registered:
            block = member.identity.block_size if member.identity is not None else 0
            registered = f"registered by this gateway (engine id {state.engine_id}, block size {block})"
        elif member.failed:
            registered = "NOT registered: no reuse (see the gateway's ERROR log)"
        elif member.registers:
            registered = "not registered yet (registered once it answers)"
        elif state.engine_id and record is not None:
            registered = "registered by another gateway"
        elif state.engine_id:
            registered = "registered by another gateway (not seen in the registry yet)"
        else:
            registered = "not registered: plain routing, no reuse (register_in_registry false)"
        models = sorted({state.model, *state.models} - {""})
        out.append(
            Route(
                state.url,
                state.role,
                ", ".join(models),
                "connector" if connector or (member is not None and member.connector) else "compatibility",
                registered,
                state.healthy,
            )
        )
    return out
