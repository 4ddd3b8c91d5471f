"""The Store interface and its backends; ``open_store`` picks one from settings."""

from __future__ import annotations

from pathlib import Path

from kvbridge_services.common.config import StoreSettings

from . import base
from .base import *  # noqa: F403  (the Store interface, re-exported)


def open_store(settings: StoreSettings, *, data_dir: Path | None = None) -> base.Store:
    """etcd when endpoints are configured, else the embedded MemoryStore
    (durable when ``data_dir`` is given, in-memory only otherwise)."""
    if settings.etcd_endpoints:
        from .etcd import EtcdStore

        return EtcdStore(settings.etcd_endpoints, timeout=settings.etcd_timeout_s, tls=settings.etcd_tls())
    from .memory import MemoryStore

    return MemoryStore(data_dir=data_dir)


__all__ = [*base.__all__, "open_store"]
