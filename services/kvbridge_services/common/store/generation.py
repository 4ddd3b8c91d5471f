"""A new store generation on any backend (ADR 0024): retire the older generation's soft state in place.

The embedded store does this itself when it opens a rolled-back directory (``MemoryStore``); this is the same rule
for a store that cannot tell, an etcd cluster restored from a snapshot: run it with every kvbridge service stopped
(``kvbridge store new-generation --etcd ...``), before they start on the restored data.
"""

from __future__ import annotations

from kvbridge_services.common.keys import is_soft_state

from .base import DEFAULT_TIMEOUT_S, Delete, Store

_PAGE = 1000
_DELETES_PER_TXN = 100  # under etcd's default --max-txn-ops (128)


async def retire_soft_state(store: Store, prefix: bytes, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    """Deletes every soft-state key under ``prefix`` (entries, idempotency records, close tombstones, leases but
    node leases); the number deleted."""
    doomed: list[bytes] = []
    after: bytes | None = None
    while True:
        page, _ = await store.range_prefix(prefix, start_after=after, limit=_PAGE, timeout=timeout)
        doomed.extend(kv.key for kv in page if is_soft_state(kv.key, kv.value))
        if len(page) < _PAGE:
            break
        after = page[-1].key
    for start in range(0, len(doomed), _DELETES_PER_TXN):
        await store.txn([], [Delete(key) for key in doomed[start : start + _DELETES_PER_TXN]], timeout=timeout)
    return len(doomed)
