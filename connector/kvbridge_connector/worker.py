"""Worker half: a prefill's read notification does not free lease-held blocks; P reads only in time.

Extends vLLM's ``NixlPullConnectorWorker``. The scheduler names the requests to
hold (``kvbridge_hold``) and to release (``kvbridge_release``) in the connector
metadata; hold deadlines travel in vLLM's own ``reqs_to_send``. On a prefill, the
read deadlines of offers (``kvbridge_read_by``) are checked again right before
each READ starts (after a handshake too), through vLLM's own expired-read decline.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cachetools import FIFOCache
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from kvbridge import offers
from kvbridge_connector.scheduler import META_FORGET_ENGINES, META_HOLD, META_READ_BY, META_RELEASE
from kvbridge_connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata, ReqMeta
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so vLLM's logging config formats and shows these records.
log = logging.getLogger(f"vllm.{__name__}")

# Bound on remembered request ids (released holds, pending read deadlines).
_MAX_REMEMBERED = 8192


@contextmanager
def _nixl_progress_thread(enabled: bool) -> Iterator[None]:
    """Build the NIXL agent with or without its progress thread.

    vLLM builds the agent config inside the worker constructor from the module-level
    ``nixl_agent_config``; wrap it for the duration of our constructor only.
    """
    original = getattr(base_worker, "nixl_agent_config", None)
    if enabled or original is None:
        yield
        return
    setattr(base_worker, "nixl_agent_config", functools.partial(original, enable_prog_thread=False))  # noqa: B010
    try:
        yield
    finally:
        setattr(base_worker, "nixl_agent_config", original)  # noqa: B010


def _notif_request(notif: bytes) -> str:
    """The request id of a read notification ``"<request id>:<readers>"`` ("" for other messages)."""
    text = notif.decode("utf-8", "replace")
    return "" if text.startswith("HB:") else text.rsplit(":", 1)[0]


class KvbridgeConnectorWorker(NixlPullConnectorWorker):
    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> None:
        with _nixl_progress_thread(settings.nixl_progress_thread):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if not settings.nixl_progress_thread:
            log.info("kvbridge: NIXL agent runs without its progress thread")
        self._kvbridge_held: set[str] = set()
        # Refcount-held requests freed by the scheduler (bounded): their late read notifications are ours.
        self._kvbridge_released: FIFOCache[str, None] = FIFOCache(maxsize=_MAX_REMEMBERED)
        self._kvbridge_read_by: FIFOCache[str, float] = FIFOCache(maxsize=_MAX_REMEMBERED)
        # Remote engines seen under a new incarnation whose old NIXL state is still to be dropped.
        self._kvbridge_forget: set[str] = set()

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        # Before the parent starts this step's READs, which check them.
        self._kvbridge_read_by.update(getattr(metadata, META_READ_BY, None) or {})
        self._kvbridge_forget.update(getattr(metadata, META_FORGET_ENGINES, None) or ())
        if self._kvbridge_forget:
            self._forget_old_incarnations()
        super().start_load_kv(metadata)
        hold: set[str] = getattr(metadata, META_HOLD, set())
        release: set[str] = getattr(metadata, META_RELEASE, set())
        self._kvbridge_held.update(hold)
        for request_id in hold:
            if request_id not in self._reqs_to_send:
                # Held by the scheduler's own reference: vLLM freed the request, so the parent must stop
                # tracking it. Left in _reqs_to_process, a prefill's read notification would be reported
                # as "finished sending" for a request the scheduler no longer has, which kills the engine
                # (assert req_id in self.requests in Scheduler._update_from_kv_xfer_finished).
                self._reqs_to_process.discard(request_id)
        for request_id in release:
            self._kvbridge_held.discard(request_id)
            if request_id in self._reqs_to_send:
                self._reqs_to_send[request_id] = 0.0  # reaped (freed) in this step's get_finished
            else:
                self._kvbridge_released[request_id] = None

    def _forget_old_incarnations(self) -> None:
        """Drops the NIXL state (remote agents, descriptors) of engines restarted under the same id, so the next
        READ from one handshakes with the new process; vLLM's own release of a replaced peer, done at once. An
        engine with a READ or a handshake in flight is left for a later step."""
        with self._handshake_lock:
            if self._handshake_futures:
                return
            known = self._kvbridge_forget & self._remote_agents.keys()
        self._kvbridge_forget &= known  # an engine with nothing cached handshakes on its next READ anyway
        for engine_id in known - self._engines_with_inflight_transfers():
            self._cleanup_remote_engine(engine_id, log_eviction=False)
            self._kvbridge_forget.discard(engine_id)
            log.info("kvbridge: dropped the NIXL state of engine %s (restarted under the same id)", engine_id)

    def _read_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        """A READ past the offer's deadline is declined through vLLM's own expired-read path (P recomputes)."""
        deadline = self._kvbridge_read_by.get(req_id)
        if deadline is not None and meta.remote is not None and offers.too_late(deadline, time.time()):
            log.warning("kvbridge: READ for %s would start after its offer's deadline; declining", req_id)
            meta.remote.blocks_expiry_time = -math.inf
        super()._read_blocks_for_req(req_id, meta)

    def _get_new_notifs(self) -> set[str]:
        """Read notifications for held requests keep the blocks (multi-use while the lease lives)."""
        held_deadlines = {r: self._reqs_to_send[r] for r in self._kvbridge_held if r in self._reqs_to_send}
        with self._without_refcount_held_notifs():
            notified = super()._get_new_notifs()
        for request_id in notified & held_deadlines.keys():
            self._reqs_to_send[request_id] = held_deadlines[request_id]
            self._reqs_to_process.add(request_id)
            log.debug("kvbridge: %s was read by a prefill; still held by its lease", request_id)
        return notified - held_deadlines.keys()

    @contextmanager
    def _without_refcount_held_notifs(self) -> Iterator[None]:
        """Drops read notifications for requests the scheduler holds by refcount: vLLM no longer
        tracks them, and would log each read as one of "unrecognized" (possibly stale) blocks."""
        wrapper = self.nixl_wrapper
        refcount_held = {r for r in self._kvbridge_held if r not in self._reqs_to_send}
        refcount_held.update(self._kvbridge_released)
        if not refcount_held:
            yield
            return
        fetch = wrapper.get_new_notifs

        def filtered() -> dict[str, list[bytes]]:
            out: dict[str, list[bytes]] = {}
            for agent, notifs in fetch().items():
                out[agent] = [n for n in notifs if _notif_request(n) not in refcount_held]
            return out

        wrapper.get_new_notifs = filtered
        try:
            yield
        finally:
            del wrapper.get_new_notifs  # back to the class method

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        super()._reap_expired_send_leases(done_sending)
        self._kvbridge_held.difference_update(done_sending)
