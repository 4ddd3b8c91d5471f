"""Compatibility-mode registration: after a turn on a stock decode engine, the gateway registers the state D
retained (its returned params) under a fresh entry lease, so the next turn can pull it.

The checks are one pure function (:func:`plan_registration`); :class:`CompatRegistrar` does the I/O (grant,
register, take the lease back when the entry did not land).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from cachetools import LRUCache

from kvbridge import secret as kvsecret
from kvbridge.errors import Reason
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from . import kvparams, reuse
from .chaincache import ChainCache, Scope
from .control import ControlPlane, ControlPlaneError
from .engines import EngineState
from .metrics import GatewayMetrics
from .turn import Turn
from .turnstate import TurnPlan

log = logging.getLogger(__name__)

# A deadline closer than this counts as passed (vLLM's P uses the same slack on D's expiry).
EXPIRY_MARGIN_S = 5.0
_EXPIRY_PARAM = "remote_blocks_expiry_time"
# The kvbridge connector marks D's returned params when it retains the blocks under its own lease.
RETAINED_PARAM = kvsecret.RETAINED
_MAX_CLOCKS = 10_000  # cap of the engine clock table (one row per decode engine)


class Skip(StrEnum):
    """Why nothing is registered (the registrations metric's label)."""

    NOTHING_RETAINED = "nothing_retained"  # D kept no blocks (or its params are malformed)
    CONNECTOR_REGISTERS = "connector_registers"  # D's kvbridge connector registers its own entry
    ENGINE_MISMATCH = "engine_mismatch"  # D reported another engine id than the one we sent the turn to
    EXPIRED = "expired"  # D's fixed hold is (nearly) over already
    TOO_SHORT = "too_short"  # not one whole block retained
    # A stock D that is not registered (its registration pending or failed, or routed without registration): its
    # block size and NIXL identity are not known, and the registry would refuse the entry (ADR 0027).
    ENGINE_UNREGISTERED = "engine_unregistered"


@dataclass(frozen=True, slots=True)
class Registration:
    """What to register: D's retained blocks, whole blocks only, until ``expire_s`` (wall time)."""

    retained: kvparams.Retained
    block_size: int
    full_blocks: int  # blocks whose hashes the entry carries
    expire_s: float
    lease_ttl_s: float


@dataclass(frozen=True, slots=True)
class RegistrationCheck:
    outcome: Registration | Skip
    # A lower bound of D's clock minus ours, learned from D's own deadline (None: not learned this turn).
    clock_offset_low: float | None = None
    engine_id: str = ""


def connector_registers(engine: EngineState, params: object, *, record: bool = True) -> bool:
    """Whether D runs the kvbridge connector (its record says so, or it marked the response retained).
    ``record=False``: only whether this response says D retained the turn (a connector D that kept nothing
    answers without the mark)."""
    if record and engine.record is not None and reuse.CONNECTOR_CAPABILITY in engine.record.capabilities:
        return True
    return isinstance(params, dict) and params.get(RETAINED_PARAM) is True


def plan_registration(
    engine: EngineState,
    params: object,
    sequence_len: int,
    *,
    block_size: int,
    decode_sent_s: float,
    decode_answered_s: float,
    now_s: float,
    hold_s: float,
    entry_lease_ttl_s: float,
) -> RegistrationCheck:
    """Decides what a stock D's returned ``params`` let the gateway register.

    Stock D holds the blocks for its fixed ``hold_s`` (decoder_kv_blocks_ttl) from when it finished, so no
    later than decode_sent + hold: the entry's deadline, which no lease renewal extends (lookups refuse an
    entry past it). D's own deadline on its clock tells how its clock relates to ours (for P's expiry check).
    """
    retained = kvparams.retained_from_decode(params, sequence_len)
    if retained is None:
        return RegistrationCheck(Skip.NOTHING_RETAINED)
    if connector_registers(engine, params):
        # Its entry lives under its own lease and D frees the blocks when that lease ends: an entry of ours
        # would outlive them (and supersede the connector's).
        return RegistrationCheck(Skip.CONNECTOR_REGISTERS)
    if engine.pending_registration or not engine.engine_id:
        return RegistrationCheck(Skip.ENGINE_UNREGISTERED)
    if retained.engine_id != engine.engine_id:
        return RegistrationCheck(Skip.ENGINE_MISMATCH, engine_id=retained.engine_id)
    offset = None
    d_expiry = params.get(_EXPIRY_PARAM) if isinstance(params, dict) else None
    if isinstance(d_expiry, int | float) and not isinstance(d_expiry, bool):
        offset = float(d_expiry) - hold_s - decode_answered_s
    expire_s = decode_sent_s + hold_s
    remaining = expire_s - now_s - EXPIRY_MARGIN_S
    if remaining <= 0:
        return RegistrationCheck(Skip.EXPIRED, offset, retained.engine_id)
    full = retained.token_count // block_size
    if full == 0:
        return RegistrationCheck(Skip.TOO_SHORT, offset, retained.engine_id)
    plan = Registration(retained, block_size, full, expire_s, min(entry_lease_ttl_s, remaining))
    return RegistrationCheck(plan, offset, retained.engine_id)


class ClockOffsets:
    """Each stock D's clock minus wall time: the largest lower bound learned from its responses (D finished
    before our receive time). Turns an entry's deadline into the remote_blocks_expiry_time P checks on D's
    clock. Bounded: one row per decode engine, the least recently used dropped past the cap."""

    def __init__(self, *, max_engines: int = _MAX_CLOCKS) -> None:
        self._by_engine: LRUCache[str, float] = LRUCache(maxsize=max_engines)

    def get(self, engine_id: str) -> float | None:
        return self._by_engine.get(engine_id)

    def learn(self, engine_id: str, offset_low: float) -> None:
        old = self._by_engine.get(engine_id)
        self._by_engine[engine_id] = offset_low if old is None else max(old, offset_low)

    def forget(self, engine_id: str) -> None:
        """A new incarnation of the engine (maybe on another host, with another clock): learn anew."""
        self._by_engine.pop(engine_id, None)


class CompatRegistrar:
    def __init__(
        self,
        control: ControlPlane,
        chains: ChainCache,
        metrics: GatewayMetrics,
        *,
        hold_s: float,
        entry_lease_ttl_s: float,
        on_registered: Callable[[tuple[str, str, str], int], None] | None = None,
    ) -> None:
        """``on_registered(conversation, epoch)``: told of each entry registered (freshness.py)."""
        self._on_registered = on_registered
        # The store refuses writes (STORE_NO_SPACE): logged once until a registration succeeds again.
        self._no_space = False
        self._control = control
        self._chains = chains
        self._metrics = metrics
        self._hold_s = hold_s
        self._entry_lease_ttl_s = entry_lease_ttl_s
        self.clocks = ClockOffsets()

    async def register(
        self,
        turn: Turn,
        engine: EngineState,
        params: object,
        seq: Sequence[int],
        *,
        block_size: int,
        turn_plan: TurnPlan,
    ) -> None:
        """``block_size``: D's. ``turn_plan``: the turn's decode timings, and its epoch (taken at registration
        time, so it is above every epoch an earlier turn could have registered)."""
        check = plan_registration(
            engine,
            params,
            len(seq),
            block_size=block_size,
            decode_sent_s=turn_plan.decode_sent_s,
            decode_answered_s=turn_plan.decode_answered_s,
            now_s=time.time(),
            hold_s=self._hold_s,
            entry_lease_ttl_s=self._entry_lease_ttl_s,
        )
        if check.clock_offset_low is not None:
            self.clocks.learn(check.engine_id, check.clock_offset_low)
        if isinstance(check.outcome, Skip):
            if check.outcome is Skip.ENGINE_MISMATCH:
                if engine.identity_probed and engine.gateway_registered:
                    # A restarted stock vLLM states a new random engine id: a new process, whose blocks are not
                    # the old entries'. No pulls from it until the gateway probed and registered it again.
                    if not engine.needs_new_incarnation:
                        engine.needs_new_incarnation = True
                        log.info(
                            "D %s now states engine id %s (restarted?): registering it again",
                            engine.url,
                            check.engine_id,
                        )
                else:
                    log.warning("D %s reported engine id %s; not registering", engine.url, check.engine_id)
            self._metrics.registrations.labels(check.outcome.value).inc()
            return
        await self._grant_and_register(turn, check.outcome, seq, turn_plan)

    async def _grant_and_register(
        self, turn: Turn, plan: Registration, seq: Sequence[int], turn_plan: TurnPlan
    ) -> None:
        retained, b = plan.retained, plan.block_size
        hashes = self._chains.chain(
            Scope(turn.tenant, turn.model, turn.cache_salt, b), turn.conversation_key, seq[: plan.full_blocks * b]
        )
        n_blocks = -(-retained.token_count // b)
        groups = [types_pb2.BlockIds(ids=g[:n_blocks]) for g in retained.block_groups]
        lease_id = 0
        try:
            lease_id = await self._control.grant_lease(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant=turn.tenant,
                engine_id=retained.engine_id,
                model=turn.model,
                conversation_key=turn.conversation_key,
                retained_tokens=retained.token_count,
                ttl_s=plan.lease_ttl_s,
            )
            entry = registry_pb2.Entry(
                key=registry_pb2.EntryKey(tenant=turn.tenant, model=turn.model, conversation_key=turn.conversation_key),
                engine_id=retained.engine_id,
                engine_request_id=retained.request_id,
                block_ids=groups,
                block_size=b,
                token_count=retained.token_count,
                block_hashes=hashes,
                chain_stride=1,
                final_block_hash=hashes[-1],
                lease_id=lease_id,
                epoch=turn_plan.epoch,
            )
            entry.expire_time.FromNanoseconds(int(plan.expire_s * 1e9))
            try:
                await self._control.register_entry(entry)
                self._no_space = False
                self._metrics.registrations.labels("ok").inc()
                if self._on_registered is not None:
                    self._on_registered(turn.conversation, int(entry.epoch))
                return
            except ControlPlaneError as exc:
                if exc.reason != Reason.STALE_EPOCH.value:
                    raise
                # A later turn's state is already registered: it wins; ours is dropped and its lease freed.
                log.info("registration superseded by a newer epoch: %s", exc)
                self._metrics.registrations.labels("superseded").inc()
                with contextlib.suppress(ControlPlaneError):
                    await self._control.revoke_lease(lease_id)
        except ControlPlaneError as exc:
            if exc.reason != Reason.STORE_NO_SPACE.value:
                log.warning("compatibility-mode registration failed: %s", exc)
            elif not self._no_space:  # once per episode: the registry and lease manager say the rest
                self._no_space = True
                log.warning("compatibility-mode registrations fail until etcd takes writes again: %s", exc)
            self._metrics.registrations.labels("failed").inc()
            if lease_id:
                with contextlib.suppress(ControlPlaneError):
                    await self._control.revoke_lease(lease_id)
