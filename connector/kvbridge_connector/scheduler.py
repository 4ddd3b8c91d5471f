"""Scheduler half: retains decode KV under kvbridge leases; checks what prefill pulls.

Extends vLLM's ``NixlPullConnectorScheduler``; overrides only ``request_finished``,
``build_connector_meta``, ``update_connector_output``, ``update_state_after_alloc`` and
``get_num_new_matched_tokens`` and always calls the parent first (except for a
read-back already attempted once, see ``get_num_new_matched_tokens``). On D the last two
also tell the retention table what requests ask for (ADR 0026: retained KV never delays
admission). Spans (when
tracing is on): D's registrations (``control_plane``), P's pulls and declines.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from cachetools import FIFOCache
from google.protobuf import duration_pb2
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

from kvbridge import offers
from kvbridge.types.v1 import types_pb2
from kvbridge_connector import control_plane as cp
from kvbridge_connector.params import RETAINED, parse_conversation, prompt_prefix_problem, pull_offer_problem
from kvbridge_connector.pulls import PullReporter, bytes_per_token
from kvbridge_connector.retention import RetainVerdict, RetentionTable
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_connector.tracing import ConnectorTracer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so vLLM's logging config formats and shows these records.
log = logging.getLogger(f"vllm.{__name__}")

_PREFIX_CHECKED = "_kvbridge_prefix_checked"

# Attribute names added to NixlConnectorMetadata for the worker half.
META_HOLD = "kvbridge_hold"
META_RELEASE = "kvbridge_release"
# Prefill: request id -> Unix time by which its READ of D's blocks must start (offers.read_deadline).
META_READ_BY = "kvbridge_read_by"
# Prefill: remote engine ids seen under a new incarnation: the worker drops its NIXL state of the old process.
META_FORGET_ENGINES = "kvbridge_forget_engines"
# Bound on the requests whose pull decision was already traced (vLLM may ask again while a request waits).
_MAX_DECIDED = 4096


def engine_record(
    vllm_config: VllmConfig,
    engine_id: str,
    settings: ConnectorSettings,
    host: str,
    port: int,
    kv_groups: int,
    total_blocks: int,
) -> types_pb2.Engine:
    parallel = vllm_config.parallel_config
    kv_role = vllm_config.kv_transfer_config.kv_role if vllm_config.kv_transfer_config else "kv_both"
    role = {"kv_consumer": types_pb2.ENGINE_ROLE_DECODE, "kv_producer": types_pb2.ENGINE_ROLE_PREFILL}.get(
        str(kv_role), types_pb2.ENGINE_ROLE_BOTH
    )
    offer_window = duration_pb2.Duration()
    offer_window.FromNanoseconds(int(settings.offer_window_s * 1e9))
    return types_pb2.Engine(
        engine_id=engine_id,
        role=role,
        model=served_model(vllm_config, settings),
        http_url=settings.http_url,
        kv_host=host,
        kv_port=port,
        dp_rank=parallel.data_parallel_index,
        dp_size=parallel.data_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        dcp_size=parallel.decode_context_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        kv_group_count=kv_groups,
        total_kv_blocks=total_blocks,
        capabilities=["bidirectional_kv_xfer", "kvbridge_connector", *settings.secret_capabilities()],
        offer_window=offer_window,
    )


def served_model(vllm_config: VllmConfig, settings: ConnectorSettings) -> str:
    if settings.model:
        return settings.model
    name = vllm_config.model_config.served_model_name
    return str(name[0] if isinstance(name, (list, tuple)) else name)


class KvbridgeConnectorScheduler(NixlPullConnectorScheduler):
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        control_plane: cp.ControlPlane | None = None,
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.settings = settings
        kv_transfer = vllm_config.kv_transfer_config
        self.is_decode = kv_transfer is not None and kv_transfer.kv_role == "kv_consumer"
        self.model_name = served_model(vllm_config, settings)
        self.retention = RetentionTable(
            time.perf_counter,
            settings.fallback_ttl_s,
            settings.max_retained_entries,
            settings.free_kv_watermark,
            free_grace_s=settings.free_grace_s,
            demand_window_s=settings.demand_window_s,
            horizon_s=settings.free_grace_s + settings.rpc_deadline_s,
        )
        # Decode: KV blocks each request vLLM asked about this step wants (dropped once it is allocated), and
        # what those left waiting wanted at the last step (ADR 0026).
        self._asked: dict[str, int] = {}
        self._waiting_blocks = 0
        self._block_pool: BlockPool | None = None
        # Refcount-held retained blocks by request id (hold_blocks="refcount").
        self._held_blocks: dict[str, list[KVCacheBlock]] = {}
        # Recently freed refcount-held requests (bounded): vLLM must never hear of them either.
        self._refcount_released: FIFOCache[str, None] = FIFOCache(maxsize=_MAX_DECIDED)
        # Requests the worker must start holding (sent with the next metadata).
        self._hold_ids: set[str] = set()
        # Prefill: read deadlines of offers being loaded (sent with the next metadata).
        self._read_by: dict[str, float] = {}
        # Prefill: the last incarnation offered per remote engine id (bounded), and ids whose incarnation changed.
        self._source_incarnations: FIFOCache[str, int] = FIFOCache(maxsize=_MAX_DECIDED)
        self._forget_engines: set[str] = set()
        self.tracer = ConnectorTracer.from_settings(settings, engine_id)
        self._decided: OrderedDict[str, None] = OrderedDict()
        self._kv_groups = max(1, len(kv_cache_config.kv_cache_groups))
        self.control_plane = control_plane
        # Both roles register (the gateway routes by the registry); only decode engines retain entries.
        if self.control_plane is None and settings.control_plane_enabled:
            self.control_plane = cp.ControlPlane(
                settings,
                engine_record(
                    vllm_config,
                    engine_id,
                    settings,
                    self.side_channel_host,
                    self.side_channel_port,
                    len(kv_cache_config.kv_cache_groups),
                    kv_cache_config.num_blocks,
                ),
                self.tracer,
            )
            self.control_plane.start()
        self.pulls = PullReporter(bytes_per_token(kv_cache_config, vllm_config.cache_config.block_size))

    # ---- vLLM hooks ----------------------------------------------------
    def bind_block_pool(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_decode and self.control_plane is not None:
            # vLLM asks about each waiting request it tries to admit: its demand, until it is allocated.
            self._asked[request.request_id] = self._blocks_needed(request, num_computed_tokens)
        params = request.kv_transfer_params
        offered = bool(
            params and params.get("do_remote_decode") and params.get("remote_block_ids") and not self.is_decode
        )
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # One read-back attempt per request. vLLM 0.32.0 re-arms a *failed* read-back (e.g. D died)
            # here, but never starts the transfer again, so the request waits forever; recompute instead.
            if offered:
                self._trace_decline(request, num_computed_tokens, "read_back_already_attempted")
            return 0, False
        # The offer's read deadline (kvbridge.offers), on this host's clock from the request's arrival.
        deadline = offers.read_deadline(params, request.arrival_time) if offered and params else None
        if offered and params and not params.get(_PREFIX_CHECKED):
            problem = (
                pull_offer_problem(params, self.settings.hash_secret, accepted_at=request.arrival_time)
                if self.settings.require_signed_offer
                else ""
            ) or prompt_prefix_problem(
                params, request.prompt_token_ids or (), required=self.settings.require_prefix_digest
            )
            params[_PREFIX_CHECKED] = True  # vLLM may ask again while the request waits: check once
            if not problem and deadline is None and self.settings.require_offer_deadline:
                problem = "no_offer_deadline"
            if problem:
                # Never load KV verified for other tokens: without the block ids vLLM neither pulls
                # nor contacts D, and P computes the prompt itself.
                params.pop("remote_block_ids", None)
                log.warning("kvbridge: declining the pull for request %s: %s", request.request_id, problem)
                self._trace_decline(request, num_computed_tokens, problem)
                return 0, False
        if params and deadline is not None and offers.too_late(deadline, time.time()):
            # Waited in P's queue past the offer's deadline: D may free the blocks before the READ.
            params.pop("remote_block_ids", None)
            log.warning(
                "kvbridge: declining the pull for request %s: the offer expired in the queue", request.request_id
            )
            self._trace_decline(request, num_computed_tokens, "offer_expired")
            return 0, False
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count > 0 and offered and params:
            # Prefill pulling back from a decode engine (the gateway verified and truncated the
            # params); vLLM may ask twice for one request, the first ask starts the clock.
            blocks = -(-count // max(self.block_size, 1)) * self._kv_groups
            self.pulls.start(
                request.request_id,
                count,
                str(params.get("remote_engine_id")),
                blocks=blocks,
                parent=self.tracer.parent_of(request),
            )
            if deadline is not None:
                self._read_by[request.request_id] = deadline  # the worker checks it again at the READ
            self._note_incarnation(params)
        elif offered:
            self._trace_decline(request, num_computed_tokens)
        return count, is_async

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._asked.pop(request.request_id, None)  # admitted: no longer waiting for blocks

    def _blocks_needed(self, request: Request, num_computed_tokens: int) -> int:
        """New KV blocks a request takes on this engine by its end (prompt and the most it may generate), less
        its local prefix-cache hit (``num_computed_tokens``, whole blocks: a retained entry's blocks are shared)."""
        size = max(self.block_size, 1)
        tokens = request.num_prompt_tokens + max(0, int(request.max_tokens or 0))
        return max(0, -(-tokens // size) - num_computed_tokens // size) * self._kv_groups

    def _note_incarnation(self, params: dict[str, Any]) -> None:
        """A decode engine restarted under the same engine id has new NIXL memory registrations: what this
        prefill cached of the old process (vLLM keys it by engine id) would fail every READ, so the worker drops it
        before this request's READ and vLLM handshakes again. (The offer is signed: no caller fakes one.)"""
        engine_id, incarnation = (
            str(params.get("remote_engine_id", "")),
            params.get(offers.KV_PARAMS_SOURCE_INCARNATION),
        )
        if not engine_id or isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation <= 0:
            return
        previous = self._source_incarnations.get(engine_id)
        self._source_incarnations[engine_id] = incarnation
        if previous is not None and previous != incarnation:
            log.info(
                "kvbridge: engine %s has a new incarnation; its NIXL state is dropped before the next READ", engine_id
            )
            self._forget_engines.add(engine_id)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        if not (self.is_decode and delay_free and params and self.control_plane is not None):
            return delay_free, params
        conversation = parse_conversation(
            request.kv_transfer_params,
            self.model_name,
            self.settings.hash_secret,
            accepted_at=getattr(request, "arrival_time", None),
        )
        if conversation is None:
            return delay_free, params  # stock single-use behaviour
        request_id = request.request_id
        blocks = tuple(tuple(int(b) for b in group) for group in params["remote_block_ids"])
        free, total = self._kv_free_blocks()
        verdict = self.retention.verdict(free, total, self._waiting_blocks)
        if verdict is not RetainVerdict.RETAIN:
            # Retained KV is a cache: under pressure these blocks go to live requests at once. Never registered,
            # so never offered: no grace. No params: nothing may be read back from them.
            self._reqs_need_send.pop(request_id, None)
            log.info(
                "kvbridge: not retaining request %s (%d blocks): %s (free %s, withdrawing %d, waiting %d)",
                request_id,
                sum(len(g) for g in blocks),
                verdict.value,
                free,
                self.retention.withdrawn_blocks(),
                self._waiting_blocks,
            )
            return False, None
        token_count = int(params["remote_num_tokens"])
        deadline = self.retention.retain(request_id, sum(len(g) for g in blocks), token_count, conversation)
        if self._block_pool is not None and self.settings.hold_blocks == "refcount":
            # Our own reference keeps the blocks; vLLM frees the request now and can go idle.
            held = [self._block_pool.blocks[b] for group in blocks for b in group]
            self._block_pool.touch(held)
            self._held_blocks[request_id] = held
            self._reqs_need_send.pop(request_id, None)
            delay_free = False
        else:
            # Replace the fixed decoder_kv_blocks_ttl with our (extendable) hold deadline.
            self._reqs_need_send[request_id] = deadline
        self._hold_ids.add(request_id)  # the worker keeps P's read notifications from freeing it
        params["remote_blocks_expiry_time"] = None  # the lease, not a fixed time, bounds reuse
        params[RETAINED] = True
        self.control_plane.submit(
            cp.RegisterEntry(
                request_id=request_id,
                conversation=conversation,
                block_ids=blocks,
                token_ids=tuple(request.all_token_ids[:token_count]),
                cache_salt=request.cache_salt or "",
                parent=self.tracer.parent_of(request),
                submitted_ns=time.time_ns() if self.tracer.enabled else 0,
            )
        )
        return delay_free, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._apply_control_plane_events()
        free, total = self._kv_free_blocks()
        # Asked about this step and not allocated: they wait for blocks.
        self._waiting_blocks = sum(self._asked.values())
        self._asked.clear()
        decisions = self.retention.step(free, total, self._waiting_blocks)
        for request_id, deadline in decisions.deadlines.items():
            if request_id not in self._held_blocks:
                self._reqs_need_send[request_id] = deadline
        self._free_held(decisions.release)
        if self.control_plane is not None:
            for lease_id, reason in decisions.revoke:
                self.control_plane.submit(cp.RevokeLease(lease_id, reason))
        if decisions.revoke:
            log.info(
                "kvbridge: withdrawing %d retained entr%s (%s%s); their blocks stay until the end is confirmed "
                "and %.0f s more (free %s, waiting %d)",
                len(decisions.revoke),
                "y" if len(decisions.revoke) == 1 else "ies",
                ", ".join(sorted({reason for _, reason in decisions.revoke})),
                "".join(f"; {r.value}" for r in sorted({r for _, r in decisions.withdrawn})),
                self.settings.free_grace_s,
                free,
                self._waiting_blocks,
            )
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, META_HOLD, self._hold_ids)
        setattr(meta, META_RELEASE, decisions.release)
        setattr(meta, META_READ_BY, self._read_by)
        setattr(meta, META_FORGET_ENGINES, self._forget_engines)
        self._hold_ids = set()
        self._read_by = {}
        self._forget_engines = set()
        if decisions.release:
            log.info("kvbridge: releasing retained KV of %d request(s)", len(decisions.release))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sending = connector_output.finished_sending
        stray = sending & self._refcount_ids() if sending else set()
        if sending and stray:
            # vLLM freed these requests when we took our own reference; a "finished sending" for one would
            # fail the scheduler's bookkeeping (assert req_id in self.requests). The worker never reports
            # them; this keeps a slip there from killing the engine.
            log.error("kvbridge: dropping finished-sending reports of refcount-held request(s) %s", sorted(stray))
            sending.difference_update(stray)
        super().update_connector_output(connector_output)
        for request_id in connector_output.finished_sending or ():
            self.retention.freed(request_id)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for request_id in connector_output.finished_recving or ():
            pull = self.pulls.finish(request_id, failed=request_id in failed)
            if pull is not None:
                self.tracer.pull_finished(pull)

    def shutdown(self) -> None:
        if self.control_plane is not None:
            self.control_plane.stop()
        self.tracer.shutdown()
        super().shutdown()  # type: ignore[no-untyped-call]

    # ---- internals -----------------------------------------------------
    def _free_held(self, released: set[str]) -> None:
        """Drops our reference on blocks held by refcount: released entries and expired holds.

        Runs at a scheduler step: an idle engine reclaims them when it next has work, which is
        the first moment anything could need the memory.
        """
        if not self._held_blocks or self._block_pool is None:
            return
        now = time.perf_counter()
        expired = {
            r for r in self._held_blocks if (entry := self.retention.get(r)) is None or entry.hold_deadline < now
        }
        for request_id in (released | expired) & self._held_blocks.keys():
            self._block_pool.free_blocks(reversed(self._held_blocks.pop(request_id)))
            self.retention.freed(request_id)
            self._refcount_released[request_id] = None

    def _apply_control_plane_events(self) -> None:
        if self.control_plane is not None:
            cp.apply_events(self.retention, self.control_plane.drain())

    def _refcount_ids(self) -> set[str]:
        """Requests whose blocks we hold (or held) by our own reference, not through vLLM."""
        return self._held_blocks.keys() | self._refcount_released.keys()

    def _decline_reason(self, request: Request, num_computed_tokens: int) -> str:
        """Why vLLM's parent answered 0 for blocks D offered (mirrors its checks in 0.32.0)."""
        params = request.kv_transfer_params or {}
        if not all(k in params for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")):
            return "incomplete_params"
        offered = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        if offered <= 0:
            return "nothing_offered"
        if offered <= num_computed_tokens:
            return "local_prefix_cache"
        return "below_recompute_threshold"

    def _trace_decline(self, request: Request, num_computed_tokens: int, reason: str = "") -> None:
        """One span per request and decision kind, however often vLLM asks while the request waits."""
        if not self.tracer.enabled:
            return
        try:
            reason = reason or self._decline_reason(request, num_computed_tokens)
            key = f"{request.request_id}:{reason}"
            if key in self._decided:
                return
            self._decided[key] = None
            while len(self._decided) > _MAX_DECIDED:
                self._decided.popitem(last=False)
            params = request.kv_transfer_params or {}
            self.tracer.pull_declined(request, reason, int(params.get("remote_num_tokens") or 0))
        except Exception:  # noqa: BLE001 - tracing must never break the scheduler
            self.tracer.failed("pull decline")

    def _kv_free_blocks(self) -> tuple[int | None, int | None]:
        if self._block_pool is None:
            return None, None
        return int(self._block_pool.get_num_free_blocks()), int(self._block_pool.num_gpu_blocks)
