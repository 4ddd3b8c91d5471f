"""The kvbridge connector's vLLM-free half on an engine simulator (test tool): connector mode without vLLM.

The real connector (connector/kvbridge_connector) splits into a part that needs vLLM (scheduler hooks, block
pool, NIXL worker) and a part that does not: the control-plane thread (``control_plane.ControlPlane``), the
retention table (``retention.RetentionTable``: which retained requests keep their blocks, until when), the
signed-field checks (``params``) and the settings. This module drives that second part, unchanged, from the
simulator's request path, where the scheduler would, so a gateway in connector mode, the registry and the lease
manager can be tested and benchmarked with simulated engines:

- the engine registers itself (a node lease kept alive), with the connector's capabilities and offer window;
- P pulls only a pull offer that the connector's checks accept (``params.pull_offer_problem``,
  ``params.prompt_prefix_problem``, a read deadline; the ``kvbridge_require_*`` settings honoured), and computes
  the prompt otherwise;
- D, after a request whose ``kvbridge_*`` fields carry a gateway's valid signature (``parse_conversation``),
  retains the request's blocks by reference (a READ does not free them) and registers the entry; from then on
  the retention table decides: the hold deadline it extends while the control plane confirms the lease, the
  blocks it releases ``free_grace_s`` after the lease's end is confirmed, the leases it revokes (memory
  pressure, entry cap, a registration that may have landed after its blocks were freed);
- with the simulator's admission model (``SimConfig.admission``) D also tells the table the blocks running
  requests took (free blocks exclude them) and what the request waiting for blocks asks for, as the scheduler
  does from vLLM's block pool, ``get_num_new_matched_tokens`` and ``update_state_after_alloc``: the headroom, the
  withdrawals ahead of need and the retention verdict (ADR 0026) are the connector's own.

Not modelled: what vLLM's scheduler adds around it (its block pool's reference counts, the NIXL worker's read
notifications, ``offer_expired`` declines of a READ that would start too late: the simulator reads at once).
Events are applied the way the scheduler applies them: at the start of each engine operation.
Configuration is the connector's own ``kv_connector_extra_config`` dict (``SimConfig.kvbridge_config``,
``--kvbridge-config`` JSON); ``kvbridge_registry`` turns it on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.protobuf import duration_pb2

from kvbridge import offers
from kvbridge.types.v1 import types_pb2
from kvbridge_connector import control_plane as cp
from kvbridge_connector.params import ConversationRef, parse_conversation, prompt_prefix_problem, pull_offer_problem
from kvbridge_connector.retention import RetainVerdict, RetentionTable
from kvbridge_connector.settings import ConnectorSettings

_ROLES = {
    "prefill": types_pb2.ENGINE_ROLE_PREFILL,
    "decode": types_pb2.ENGINE_ROLE_DECODE,
    "both": types_pb2.ENGINE_ROLE_BOTH,
}


class SimConnector:
    """One engine's connector: ``offer_problem`` on P, ``retain`` on D, ``step`` before each operation."""

    def __init__(
        self,
        extra: Mapping[str, Any],
        *,
        engine_id: str,
        role: str,
        model: str,
        host: str,
        port: int,
        block_size: int,
        total_blocks: int,
    ) -> None:
        self.settings = ConnectorSettings.from_extra_config(extra)
        if not self.settings.control_plane_enabled:
            raise ValueError("kvbridge_config needs kvbridge_registry (the registry's address)")
        window = duration_pb2.Duration()
        window.FromNanoseconds(int(self.settings.offer_window_s * 1e9))
        self.engine = types_pb2.Engine(
            engine_id=engine_id,
            role=_ROLES[role],
            model=self.settings.model or model,
            http_url=self.settings.http_url or f"http://{host}:{port}",
            kv_host=host,
            kv_port=port,
            dp_size=1,
            tp_size=1,
            pp_size=1,
            dcp_size=1,
            block_size=block_size,
            kv_group_count=1,
            total_kv_blocks=total_blocks,
            capabilities=["bidirectional_kv_xfer", "kvbridge_connector", *self.settings.secret_capabilities()],
            offer_window=window,
        )
        self.plane = cp.ControlPlane(self.settings, self.engine)
        settings = self.settings
        self.retention = RetentionTable(
            time.time,  # the simulator's hold deadlines are wall-clock
            settings.fallback_ttl_s,
            settings.max_retained_entries,
            settings.free_kv_watermark,
            settings.free_grace_s,
            demand_window_s=settings.demand_window_s,
            horizon_s=settings.free_grace_s + settings.rpc_deadline_s,
        )
        self.total_blocks = total_blocks
        self._retained: set[str] = set()  # request ids the table holds
        self.not_retained: dict[str, int] = {}  # D: finished requests freed at once, by RetainVerdict
        self.withdrawal_batches: list[int] = []  # D: live entries withdrawn per step that withdrew any
        self._bound: set[str] = set()  # of those, the ones registered under a lease
        self.registered = 0  # entries D registered (bound to a lease)
        self.declined: dict[str, int] = {}  # P: declined offers by reason

    def start(self) -> None:
        self.plane.start()

    def stop(self) -> None:
        self.plane.stop()

    # ---- P ----------------------------------------------------------------------------------------------------
    def offer_problem(self, params: Mapping[str, Any], prompt: Sequence[int], accepted_at: float) -> str:
        """Why P must not pull this offer ("" when it may), as the connector's scheduler decides."""
        s = self.settings
        problem = ""
        if s.require_signed_offer:
            problem = pull_offer_problem(params, s.hash_secret, accepted_at=accepted_at)
        problem = problem or prompt_prefix_problem(params, prompt, required=s.require_prefix_digest)
        if not problem and s.require_offer_deadline and offers.read_deadline(params, accepted_at) is None:
            problem = "no_offer_deadline"
        if problem:
            self.declined[problem] = self.declined.get(problem, 0) + 1
        return problem

    # ---- D ----------------------------------------------------------------------------------------------------
    def conversation(self, params: Mapping[str, Any] | None, accepted_at: float) -> ConversationRef | None:
        """The conversation a decode request belongs to, if a gateway holding the secret said so."""
        return parse_conversation(params, self.engine.model, self.settings.hash_secret, accepted_at=accepted_at)

    def retain(
        self,
        request_id: str,
        conversation: ConversationRef,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        cache_salt: str,
        *,
        free_blocks: int | None = None,
        waiting_blocks: int = 0,
    ) -> float | None:
        """Retains a finished request's blocks and queues the entry's registration; the first hold deadline.
        None: not retained (``RetentionTable.verdict`` with ``free_blocks``, which do not count these): the
        caller frees the blocks at once."""
        verdict = self.retention.verdict(
            free_blocks, self.total_blocks if free_blocks is not None else None, waiting_blocks
        )
        if verdict is not RetainVerdict.RETAIN:
            self.not_retained[verdict.value] = self.not_retained.get(verdict.value, 0) + 1
            return None
        deadline = self.retention.retain(request_id, len(block_ids), len(token_ids), conversation)
        self._retained.add(request_id)
        self.plane.submit(
            cp.RegisterEntry(
                request_id=request_id,
                conversation=conversation,
                block_ids=(tuple(block_ids),),
                token_ids=tuple(token_ids),
                cache_salt=cache_salt,
            )
        )
        return deadline

    def step(
        self,
        held: Mapping[str, Any],
        release: Callable[[str], None],
        free_blocks: int,
        total_blocks: int,
        *,
        waiting_blocks: int = 0,
    ) -> None:
        """One scheduler step: the control plane's events into the retention table, then its decisions.
        ``held``: the block store's held requests (objects with a ``deadline``), after its own fallback reaping;
        ``release(request_id)``: frees a held request's blocks; ``waiting_blocks``: what the request waiting for
        blocks asks for."""
        cp.apply_events(self.retention, self.plane.drain())
        for request_id in [r for r in self._retained if r not in held]:  # reaped at its hold deadline
            self._forget(request_id)
        decisions = self.retention.step(free_blocks, total_blocks, waiting_blocks)
        if decisions.withdrawn:
            self.withdrawal_batches.append(len(decisions.withdrawn))
        for request_id, deadline in decisions.deadlines.items():
            if request_id in held:
                held[request_id].deadline = deadline
        for request_id in decisions.release:
            release(request_id)
            self._forget(request_id)
        for lease_id, reason in decisions.revoke:
            self.plane.submit(cp.RevokeLease(lease_id, reason))
        for request_id in self._retained - self._bound:
            entry = self.retention.get(request_id)
            if entry is not None and entry.lease_id:
                self._bound.add(request_id)
                self.registered += 1

    def _forget(self, request_id: str) -> None:
        self._retained.discard(request_id)
        self._bound.discard(request_id)
        self.retention.freed(request_id)
