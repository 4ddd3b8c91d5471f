"""Prefill side: the outcome of each pull from a decode engine (tokens, bytes, time or failure).

Reported as one log line per pull plus running totals, and returned to the scheduler for its
span; byte/time histograms also come from vLLM's own NIXL metrics (``vllm:nixl_bytes_transferred``,
``vllm:nixl_xfer_time_seconds``) on the prefill engine's ``/metrics``. Timed on the scheduler:
from the step that schedules the pull to the step that sees it finished (``finished_recving``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachetools import FIFOCache

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(f"vllm.{__name__}")

_MAX_IN_FLIGHT = 4096


def bytes_per_token(kv_cache_config: KVCacheConfig, block_size: int) -> int:
    """KV bytes one token occupies across every layer of every group."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec: Any = group.kv_cache_spec
        total += int(spec.page_size_bytes) * len(group.layer_names)
    return total // max(block_size, 1)


@dataclass(slots=True)
class _Pull:
    tokens: int
    source_engine: str
    started: float
    started_ns: int  # Unix epoch, for the span
    blocks: int
    parent: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class FinishedPull:
    request_id: str
    source_engine: str
    tokens: int
    blocks: int
    bytes: int  # tokens x KV bytes per token (from the KV layout, not measured)
    seconds: float
    started_ns: int
    ended_ns: int
    failed: bool
    parent: tuple[tuple[str, str], ...]  # the turn's trace context


class PullReporter:
    def __init__(self, bytes_per_token: int) -> None:
        self._bytes_per_token = bytes_per_token
        # Pulls aborted before finishing are never finished here: the oldest is forgotten past the cap.
        self._in_flight: FIFOCache[str, _Pull] = FIFOCache(maxsize=_MAX_IN_FLIGHT)
        self.succeeded = 0
        self.failed = 0
        self.tokens_pulled = 0
        self.bytes_pulled = 0

    def start(
        self,
        request_id: str,
        tokens: int,
        source_engine: str,
        *,
        blocks: int = 0,
        parent: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if request_id in self._in_flight:
            return
        self._in_flight[request_id] = _Pull(tokens, source_engine, time.perf_counter(), time.time_ns(), blocks, parent)

    def finish(self, request_id: str, *, failed: bool) -> FinishedPull | None:
        """The finished pull (None when it was not started here); logs it and updates the totals."""
        pull = self._in_flight.pop(request_id, None)
        if pull is None:
            return None
        elapsed_s = time.perf_counter() - pull.started
        elapsed_ms = elapsed_s * 1e3
        size = pull.tokens * self._bytes_per_token
        finished = FinishedPull(
            request_id,
            pull.source_engine,
            pull.tokens,
            pull.blocks,
            size,
            elapsed_s,
            pull.started_ns,
            pull.started_ns + int(elapsed_s * 1e9),
            failed,
            pull.parent,
        )
        if failed:
            self.failed += 1
            log.warning(
                "kvbridge pull failed: request %s, %d tokens from %s after %.1f ms; recomputing",
                request_id,
                pull.tokens,
                pull.source_engine,
                elapsed_ms,
            )
            return finished
        self.succeeded += 1
        self.tokens_pulled += pull.tokens
        self.bytes_pulled += size
        # Time from scheduling to completion (includes a first NIXL handshake with that engine).
        log.info(
            "kvbridge pull: request %s pulled %d tokens (%d bytes) from %s in %.1f ms (%.1f MB/s)",
            request_id,
            pull.tokens,
            size,
            pull.source_engine,
            elapsed_ms,
            size / max(elapsed_ms, 1e-3) / 1e3,
        )
        return finished
