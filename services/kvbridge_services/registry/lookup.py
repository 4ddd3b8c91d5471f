"""Lookups, answered from the in-memory index (no store read): by conversation key, or by content (the
longest verified prefix among the tenant's entries of the model).

What an indexed entry answers a prompt, and which content match wins, are pure functions; ``Lookups`` walks
the index with them and fills the response (``common/entrylookup.py``, shared with the gateway's mirror).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Principal
from kvbridge_services.common.entrylookup import answer_hit, unusable

from . import validation as v
from .index import EntryId, IndexedEntry
from .parts import RegistryParts

# The type only: members are read as registry_pb2.LOOKUP_VERDICT_* (the enum wrapper's __getattr__ is slower)
Verdict = registry_pb2.LookupVerdict


@dataclass(frozen=True, slots=True)
class Refused:
    """The entry cannot answer the lookup; ``verdict`` says why."""

    verdict: Verdict.ValueType


def keyed_match(
    item: IndexedEntry, engine: types_pb2.Engine | None, block_size: int, prompt: Sequence[bytes], now_s: float
) -> Refused | int:
    """What the conversation's entry answers ``prompt``: the blocks it verifies (at least one), or why not.

    ``engine``: the index's record of the entry's engine (None: not registered).
    """
    verdict = unusable(item.entry, block_size, now_s, engine)
    if verdict is not None:
        return Refused(verdict)
    blocks = item.record.verified_blocks(prompt)
    if blocks == 0:
        return Refused(registry_pb2.LOOKUP_VERDICT_MISMATCH)
    return blocks


def deepest_checkpoint(prompt: Sequence[bytes], stride: int, held: Callable[[bytes], bool]) -> int:
    """The deepest checkpoint j (block j*stride - 1 of ``prompt``) that ``held`` says some entry holds; 0: none.

    Binary search: chains are cumulative, so holding position j implies matching every block below j.
    """
    lo, hi = 0, len(prompt) // stride
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held(prompt[mid * stride - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def outranks(item: IndexedEntry, blocks: int, best: tuple[IndexedEntry, int] | None) -> bool:
    """Whether ``item``, verifying ``blocks``, beats ``best``: more blocks, or as many and registered later."""
    if not blocks:
        return False
    if best is None or blocks > best[1]:
        return True
    return blocks == best[1] and item.entry.register_time.ToNanoseconds() > best[0].entry.register_time.ToNanoseconds()


class Lookups:
    def __init__(self, parts: RegistryParts, *, max_content_candidates: int) -> None:
        self._parts = parts
        self._max_candidates = max_content_candidates

    def lookup(
        self, principal: Principal, request: registry_pb2.LookupEntryRequest
    ) -> registry_pb2.LookupEntryResponse:
        prompt = v.check_lookup_request(request, self._parts.limits)
        tenant = principal.tenant_for(request.tenant)
        response = registry_pb2.LookupEntryResponse(prompt_block_tokens=len(prompt) * request.block_size)
        index = self._parts.index
        if not index.fresh():
            # The index lags the store past its bound: a hit could name an entry deleted meanwhile.
            response.verdict = registry_pb2.LOOKUP_VERDICT_INDEX_STALE
            return response
        if request.conversation_key:
            item = index.entries.get((tenant, request.model, request.conversation_key))
            if item is None:
                response.verdict = registry_pb2.LOOKUP_VERDICT_NOT_FOUND
                return response
            match = keyed_match(
                item, index.engines.get(item.entry.engine_id), request.block_size, prompt, self._parts.clock()
            )
            if isinstance(match, Refused):
                response.verdict = match.verdict
                return response
            blocks = match
        else:
            best = self._best_content_match(tenant, request.model, request.block_size, prompt)
            if best is None:
                response.verdict = registry_pb2.LOOKUP_VERDICT_NOT_FOUND
                return response
            item, blocks = best
        if answer_hit(response, item.entry, index.engines[item.entry.engine_id], blocks, request.min_tokens):
            index.touch(item.id)
        return response

    def _best_content_match(
        self, tenant: str, model: str, block_size: int, prompt: Sequence[bytes]
    ) -> tuple[IndexedEntry, int] | None:
        """Longest verified prefix among the tenant's live entries of the model.

        Binary search over the prompt's checkpoint positions for the deepest one
        some entry holds (cumulative chains: holding position j implies matching
        every block below j), then the positions up to the next checkpoint for
        entries whose final block ends there.
        """
        index = self._parts.index
        stride = index.content_stride
        lo = deepest_checkpoint(prompt, stride, lambda h: bool(index.holders(tenant, model, h, limit=1)))
        cap = self._max_candidates
        candidates: list[EntryId] = []
        if lo:
            candidates += index.holders(tenant, model, prompt[lo * stride - 1], limit=cap)
        for pos in range(lo * stride, min(len(prompt), (lo + 1) * stride)):
            candidates += index.holders(tenant, model, prompt[pos], limit=cap)
        now_s = self._parts.clock()
        best: tuple[IndexedEntry, int] | None = None
        # Bounded work per lookup: many conversations sharing one prefix must not make lookups slow.
        for eid in candidates[: 2 * cap]:
            item = index.entries.get(eid)
            if item is None:
                continue
            if unusable(item.entry, block_size, now_s, index.engines.get(item.entry.engine_id)) is not None:
                continue
            blocks = item.record.verified_blocks(prompt)
            if outranks(item, blocks, best):
                best = (item, blocks)
        return best
