"""The kvbridge connector's vLLM-free half on an engine simulator (test tool): connector mode without vLLM.

The real connector (connector/kvbridge_connector) splits into a part that needs vLLM (scheduler hooks, block
pool, NIXL worker) and a part that does not: the control-plane thread (``control_plane.ControlPlane``), the
signed-field checks (``params``) and the settings. This module drives that second part, unchanged, from the
simulator's request path, so a gateway in connector mode, the registry and the lease manager can be tested and
benchmarked with simulated engines:

- the engine registers itself (a node lease kept alive), with the connector's capabilities and offer window;
- P pulls only a pull offer that ``params.pull_offer_problem`` and ``params.prompt_prefix_problem`` accept
  (signed by a gateway with the deployment secret, the prompt-prefix digest equal to P's own prompt's), as the
  connector's scheduler decides (``require_*`` settings honoured); a declined offer is computed instead;
- D, after a request whose ``kvbridge_*`` fields carry a gateway's valid signature (``parse_conversation``),
  holds the request's blocks by reference and registers the entry (grant + RegisterEntry with the token ids);
  a READ does not free them (connector mode is multi-use); they are freed when the entry's lease ends or its
  registration fails, and after ``kvbridge_fallback_ttl_s`` if no lease was bound by then.

Events are applied the way vLLM's scheduler applies them: drained at the start of each engine operation.
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
from kvbridge_connector.settings import ConnectorSettings

_ROLES = {
    "prefill": types_pb2.ENGINE_ROLE_PREFILL,
    "decode": types_pb2.ENGINE_ROLE_DECODE,
    "both": types_pb2.ENGINE_ROLE_BOTH,
}
# A held request's deadline once its entry lease is bound: the lease, not a timer, frees it.
_UNTIL_LEASE_ENDS = float("inf")
_MAX_ENDED_UNBOUND = 10_000


class SimConnector:
    """One engine's connector: ``offer_problem`` on P, ``retain`` on D, ``apply_events`` before each operation.
    ``hold``/``free``: the simulator's block store's hold (request id, block ids, deadline) and free (request
    id) operations."""

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
        self._by_lease: dict[int, str] = {}  # entry lease id -> the request id whose blocks it holds
        self._ended_unbound: set[int] = set()  # leases that ended before their LeaseBound was applied
        self.registered = 0  # entries bound to a lease
        self.declined: dict[str, int] = {}  # P: declined offers by reason
        self.registration_failures = 0

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
    ) -> float:
        """Queues the entry's registration; the deadline to hold its blocks until a lease is bound."""
        self.plane.submit(
            cp.RegisterEntry(
                request_id=request_id,
                conversation=conversation,
                block_ids=(tuple(block_ids),),
                token_ids=tuple(token_ids),
                cache_salt=cache_salt,
            )
        )
        return time.time() + self.settings.fallback_ttl_s

    def apply_events(self, held: Mapping[str, Any], release: Callable[[str], None]) -> None:
        """Applies what the control-plane thread reported: ``held`` maps request ids to objects with a
        ``deadline``; ``release(request_id)`` frees a held request's blocks."""
        for event in self.plane.drain():
            if isinstance(event, cp.LeaseBound):
                if event.lease_id in self._ended_unbound:  # revoked before the binding reached us
                    self._ended_unbound.discard(event.lease_id)
                    release(event.request_id)
                elif event.request_id in held:
                    held[event.request_id].deadline = _UNTIL_LEASE_ENDS
                    self._by_lease[event.lease_id] = event.request_id
                    self.registered += 1
            elif isinstance(event, cp.LeaseEnded):
                request_id = self._by_lease.pop(event.lease_id, None)
                if request_id is not None:
                    release(request_id)
                elif len(self._ended_unbound) < _MAX_ENDED_UNBOUND:
                    self._ended_unbound.add(event.lease_id)
            elif isinstance(event, cp.LeaseSnapshot):  # after a reconnect: what is not live has ended
                for lease_id in [i for i in self._by_lease if i not in event.live_lease_ids]:
                    release(self._by_lease.pop(lease_id))
            elif isinstance(event, cp.RegistrationFailed):
                self.registration_failures += 1
                if event.withdrawn:
                    release(event.request_id)
