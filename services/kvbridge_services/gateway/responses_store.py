"""Stored responses of the Responses API (``store: true``), for ``previous_response_id`` and
``GET /v1/responses/{id}``: in this gateway's memory, per tenant, bounded, least recently used first out
(ADR 0023). A response id is found only under the tenant that created it."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    thread_key: str  # the conversation key the chain's turns run under
    messages: tuple[dict[str, Any], ...]  # the chain's chat messages up to and including this answer
    size: int  # bytes charged: the whole thread's JSON and the response object


def _size(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    """Bounded per tenant (``max_per_tenant`` responses, ``max_bytes_per_tenant``) and in all
    (``max_total_bytes``); the least recently used go first. A response is charged its whole thread's bytes (a
    thread's messages are shared with its ancestors in memory, so what is held is at most what is charged)."""

    def __init__(
        self,
        *,
        max_per_tenant: int,
        max_bytes_per_tenant: int,
        max_total_bytes: int,
        on_evict: Callable[[], None] | None = None,
    ) -> None:
        """``on_evict``: called for each response evicted by a bound (a metric)."""
        self._on_evict = on_evict
        self.max_per_tenant = max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.max_total_bytes = max_total_bytes
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._all: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.total_bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._all)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        held = self._tenants.get(tenant)
        stored = held.get(response_id) if held is not None else None
        if stored is not None:
            assert held is not None
            held.move_to_end(response_id)
            self._all.move_to_end((tenant, response_id))
        return stored

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        *,
        thread_key: str,
        parent: StoredResponse | None,
        new_messages: list[dict[str, Any]],
    ) -> StoredResponse | None:
        """Stores a response (None: larger than a tenant's whole allowance, not stored)."""
        messages = (*(parent.messages if parent is not None else ()), *new_messages)
        size = (parent.size if parent is not None else 0) + _size(new_messages) + _size(response)
        if size > min(self.max_bytes_per_tenant, self.max_total_bytes):
            return None
        response_id = str(response["id"])
        stored = StoredResponse(response, thread_key, messages, size)
        self.delete(tenant, response_id)
        held = self._tenants.setdefault(tenant, OrderedDict())
        held[response_id] = stored
        self._all[(tenant, response_id)] = None
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.total_bytes += size
        while len(held) > self.max_per_tenant or self._tenant_bytes[tenant] > self.max_bytes_per_tenant:
            self._evict(tenant, next(iter(held)))
        while self.total_bytes > self.max_total_bytes:
            oldest_tenant, oldest = next(iter(self._all))
            self._evict(oldest_tenant, oldest)
        return stored

    def _evict(self, tenant: str, response_id: str) -> None:
        if self.delete(tenant, response_id):
            self.evicted += 1
            if self._on_evict is not None:
                self._on_evict()

    def delete(self, tenant: str, response_id: str) -> bool:
        held = self._tenants.get(tenant)
        stored = held.pop(response_id, None) if held is not None else None
        if stored is None:
            return False
        assert held is not None
        del self._all[(tenant, response_id)]
        self.total_bytes -= stored.size
        self._tenant_bytes[tenant] -= stored.size
        if not held:
            del self._tenants[tenant]
            del self._tenant_bytes[tenant]
        return True


__all__ = ["ResponseStore", "StoredResponse"]
