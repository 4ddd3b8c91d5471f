"""What the registry's compare-and-swap writes share: the guard that a record read as present still is, and
how often a write re-reads after losing a race before it answers ABORTED."""

from __future__ import annotations

from kvbridge.errors import Aborted, Reason
from kvbridge_services.common.store.base import Compare, CompareTarget

CAS_ATTEMPTS = 5


def exists(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, ">", 0)


def contention() -> Aborted:
    """The answer after CAS_ATTEMPTS writes lost their race: the caller retries later."""
    return Aborted(Reason.OVERLOADED, "too much contention on this conversation; retry")
