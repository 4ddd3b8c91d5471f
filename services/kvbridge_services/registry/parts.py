"""What the registry's components share, handed to each of them as one value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.store.base import Store

from . import validation as v
from .index import RegistryIndex
from .releaser import BackgroundRevoker


@dataclass(frozen=True)
class RegistryParts:
    """The store and its key layout, the in-memory index, the background lease revoker, the request limits, the
    deadline of each store call and the clock that stamps registrations."""

    store: Store
    keys: KeyLayout
    index: RegistryIndex
    revoker: BackgroundRevoker
    limits: v.Limits
    timeout_s: float
    clock: Callable[[], float]
