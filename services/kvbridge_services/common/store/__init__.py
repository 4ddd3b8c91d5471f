"""The Store interface and its backends; ``open_store`` picks one from settings."""

from __future__ import annotations

from pathlib import Path

from kvbridge_services.common.config import StoreSettings

from .base import (
    DEFAULT_TIMEOUT_S,
    Compacted,
    Compare,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    TxnResult,
    WatchBatch,
    WatchEvent,
)


def open_store(settings: StoreSettings, *, data_dir: Path | None = None) -> Store:
    """etcd when endpoints are configured, else the embedded MemoryStore
    (durable when ``data_dir`` is given, in-memory only otherwise)."""
    if settings.etcd_endpoints:
        from .etcd import EtcdStore

        return EtcdStore(settings.etcd_endpoints, timeout=settings.etcd_timeout_s, tls=settings.etcd_tls())
    from .memory import MemoryStore

    return MemoryStore(data_dir=data_dir)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Compacted",
    "Compare",
    "CompareTarget",
    "Delete",
    "EventType",
    "Get",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "open_store",
]
