"""The Store: an etcd-shaped key-value interface every service persists through.

Two backends implement it and pass one contract suite (tests/contract):
``EtcdStore`` (production, etcd v3 through etcd3aio) and ``MemoryStore``
(embedded, in-process, the default when no etcd endpoint is configured).
The interface is deliberately etcd's own model — revisions, leases, multi-key
transactions with compares, prefix watches resumable from a revision — so that
the embedded backend cannot promise anything etcd would not keep.

Keys and values are bytes; values are serialized protobuf records. Every call
takes a deadline (``timeout`` seconds) and raises ``StoreUnavailable`` when the
store cannot answer in time; callers never wait forever.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Compacted",
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "EventType",
    "Get",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "RangeQuery",
    "Store",
    "StoreError",
    "StoreNoSpace",
    "StoreUnavailable",
    "Txn",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "WatchQuery",
]

DEFAULT_TIMEOUT_S = 5.0


class StoreError(Exception):
    """Base class of store failures."""


class StoreUnavailable(StoreError):
    """The store did not answer within the deadline or is unreachable."""


class StoreNoSpace(StoreError):
    """The store refused a write because its database reached its space quota (etcd's NOSPACE alarm): nothing
    was written. Reads, deletes and lease renewals still work; writes resume once an operator has compacted,
    defragmented and disarmed the alarm (docs/etcd-space.md). Not a ``StoreUnavailable``: retrying within a
    deadline cannot help, so callers fail it at once."""


class LeaseNotFound(StoreError):
    """The store lease does not exist (expired or revoked)."""


class Compacted(StoreError):
    """A watch asked for a revision the store has already compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; oldest available is {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


class CompareTarget(enum.Enum):
    VALUE = "value"
    VERSION = "version"  # 0 means "the key does not exist"
    CREATE = "create"  # create_revision
    MOD = "mod"  # mod_revision
    LEASE = "lease"


CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True, slots=True)
class Compare:
    key: bytes
    target: CompareTarget
    op: CompareOp
    operand: int | bytes

    @staticmethod
    def absent(key: bytes) -> Compare:
        return Compare(key, CompareTarget.VERSION, "==", 0)

    @staticmethod
    def mod_revision_is(key: bytes, revision: int) -> Compare:
        return Compare(key, CompareTarget.MOD, "==", revision)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    # Delete every key that starts with ``key``.
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    # Store revision after the transaction.
    revision: int
    # One entry per Get op of the branch that ran (None: key absent).
    gets: list[KeyValue | None] = field(default_factory=list)


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    # For DELETE: key set, value empty, mod_revision = the deleting revision.
    kv: KeyValue
    # Value before the event, when the backend knows it (always on DELETE, unless the watch asked for none).
    prev_kv: KeyValue | None = None


@dataclass(frozen=True, slots=True)
class RangeQuery:
    """Keys under ``prefix`` in key order (after ``start_after``), at most ``limit`` (0: all); with ``keys_only``
    their values come back empty."""

    prefix: bytes
    start_after: bytes | None = None
    limit: int = 0
    keys_only: bool = False

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError("limit must be >= 0")


@dataclass(frozen=True, slots=True)
class Txn:
    """If every compare holds run ``success`` else ``failure``."""

    compares: Sequence[Compare]
    success: Sequence[Op]
    failure: Sequence[Op] = ()


@dataclass(frozen=True, slots=True)
class WatchQuery:
    """Changes under ``prefix`` from ``start_revision`` (0: from now on); with ``progress_interval_s`` > 0 an idle
    watch yields empty batches carrying the current revision. With ``prev_kv`` False a backend may leave out the
    previous values (etcd then neither reads nor sends them: a lease expiry deleting thousands of records)."""

    prefix: bytes
    start_revision: int = 0
    progress_interval_s: float = 0.0
    prev_kv: bool = True

    def __post_init__(self) -> None:
        if self.start_revision < 0:
            raise ValueError("start_revision must be >= 0")


@dataclass(frozen=True, slots=True)
class WatchBatch:
    events: list[WatchEvent]
    # The store revision this batch brings the watcher up to (progress
    # notifications carry no events, only this).
    revision: int


class Store(abc.ABC):
    """etcd-shaped async key-value store. All methods are coroutine-safe.

    A backend implements the abstract methods; ``range_prefix``, ``txn`` and ``watch_prefix`` are the keyword
    forms of ``read_range``, ``apply_txn`` and ``watch``, which take the request as one object."""

    @abc.abstractmethod
    async def get(self, key: bytes, *, timeout: float = DEFAULT_TIMEOUT_S) -> KeyValue | None: ...

    async def range_prefix(
        self,
        prefix: bytes,
        *,
        start_after: bytes | None = None,
        limit: int = 0,
        keys_only: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> tuple[list[KeyValue], int]:
        """Keys under ``prefix`` in key order (after ``start_after``), at most
        ``limit`` (0: all), and the store revision they were read at."""
        return await self.read_range(RangeQuery(prefix, start_after, limit, keys_only), timeout=timeout)

    @abc.abstractmethod
    async def read_range(self, query: RangeQuery, *, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[KeyValue], int]:
        """The keys ``query`` selects and the store revision they were read at."""

    @abc.abstractmethod
    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Returns the revision of the write."""

    @abc.abstractmethod
    async def delete(self, key: bytes, *, prefix: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Returns how many keys were deleted."""

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> TxnResult:
        """Atomically: if every compare holds run ``success`` else ``failure``."""
        return await self.apply_txn(Txn(compares, success, failure), timeout=timeout)

    @abc.abstractmethod
    async def apply_txn(self, txn: Txn, *, timeout: float = DEFAULT_TIMEOUT_S) -> TxnResult:
        """Runs ``txn`` atomically."""

    # --- leases: etcd semantics; expiry deletes attached keys atomically ---

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """A new lease id with the given TTL in whole seconds (>= 1)."""

    @abc.abstractmethod
    async def refresh_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Renew; returns the TTL granted. Raises LeaseNotFound."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Revoke and delete attached keys. Unknown leases are ignored."""

    @abc.abstractmethod
    async def lease_ttl(self, lease_id: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Remaining TTL in seconds; -1 when the lease does not exist."""

    # --- watch ---

    def watch_prefix(
        self,
        prefix: bytes,
        *,
        start_revision: int = 0,
        progress_interval_s: float = 0.0,
        prev_kv: bool = True,
    ) -> AsyncIterator[WatchBatch]:
        """Changes under ``prefix`` from ``start_revision`` (0: from now on): ``watch`` of a ``WatchQuery``."""
        return self.watch(WatchQuery(prefix, start_revision, progress_interval_s, prev_kv))

    @abc.abstractmethod
    def watch(self, query: WatchQuery) -> AsyncIterator[WatchBatch]:
        """The changes ``query`` selects.

        Raises ``Compacted`` if ``query.start_revision`` is older than the store keeps;
        the caller then re-lists and watches from the list's revision. With
        ``progress_interval_s`` > 0 an idle watch yields empty batches carrying
        the current revision. Closing the iterator (``aclose``) cancels the watch.
        """

    @abc.abstractmethod
    async def current_revision(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> int: ...

    def writes_refused(self) -> str | None:
        """Why the store refuses writes now (e.g. etcd's NOSPACE alarm), None while it takes them. Readiness,
        metrics and logs follow it; the embedded store has no quota and always takes writes."""
        return None

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
