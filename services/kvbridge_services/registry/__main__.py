"""Composition root: ``python -m kvbridge_services.registry`` (settings from KVBRIDGE_* env)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings, StoreSettings
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.settings_doc import SettingsModels, help_text
from kvbridge_services.common.store.base import Store
from kvbridge_services.common.telemetry import Telemetry

from .app import RegistryApp
from .config import RegistrySettings
from .workers import WORKER_FLAG, supervise

log = logging.getLogger("kvbridge_services.registry")
# /metrics is on unless KVBRIDGE_REGISTRY_METRICS_PORT says otherwise (0 turns it off).
DEFAULT_METRICS_PORT = 9151

HELP = "kvbridge metadata registry (gRPC kvbridge.registry.v1.RegistryService)."
_TELEMETRY_HELP = """

telemetry:
  OTEL_EXPORTER_OTLP_ENDPOINT    OTLP/gRPC trace collector, e.g. http://jaeger:4317 (unset: tracing off);
                                 OTEL_SERVICE_NAME (default kvbridge-registry) and the other OTEL_* apply
  KVBRIDGE_TELEMETRY_HASH_KEY_HEX key hashing tenant/conversation span attributes (share it across services)"""
# Every setting this process reads (--help and docs/settings.md are made from these).
SETTINGS: SettingsModels = (
    (RegistrySettings, {"metrics_port": f"{DEFAULT_METRICS_PORT} (0: off)"}),
    (StoreSettings, None),
    (ServerSettings, None),
    (PeerTlsSettings, None),
)


def _open_store(settings: StoreSettings) -> Store:
    if settings.embedded:
        from kvbridge_services.common.store.memory import MemoryStore

        log.warning("no KVBRIDGE_ETCD_ENDPOINTS: using the embedded in-memory store (single node, not durable)")
        return MemoryStore()
    from kvbridge_services.common.store.etcd import EtcdStore

    store: Store = EtcdStore(settings.etcd_endpoints, timeout=settings.etcd_timeout_s, tls=settings.etcd_tls())
    return store


def _settings() -> RegistrySettings:
    settings = RegistrySettings()
    if "metrics_port" not in settings.model_fields_set:
        settings = settings.model_copy(update={"metrics_port": DEFAULT_METRICS_PORT})
    return settings


def _multi_process_problem(settings: RegistrySettings, store: StoreSettings) -> str | None:
    if store.embedded:
        return (
            "KVBRIDGE_REGISTRY_SERVE_PROCESSES > 1 needs etcd (KVBRIDGE_ETCD_ENDPOINTS): the embedded "
            "in-process store cannot be shared between processes"
        )
    if settings.port == 0:
        return "KVBRIDGE_REGISTRY_SERVE_PROCESSES > 1 needs a fixed KVBRIDGE_REGISTRY_PORT, not 0"
    return None


async def _serve(worker: int | None) -> None:
    """One server process; ``worker``: its index among serve_processes processes sharing the port."""
    store_settings = StoreSettings()
    server_settings = ServerSettings()
    settings = _settings()
    if worker is not None and settings.metrics_port:
        settings = settings.model_copy(update={"metrics_port": settings.metrics_port + worker})
    telemetry = Telemetry.from_env("kvbridge-registry")
    store = _open_store(store_settings)
    app = RegistryApp(
        store,
        settings=settings,
        server_settings=server_settings,
        keys=KeyLayout(store_settings.etcd_prefix),
        auth=Authenticator.from_file(server_settings.api_keys_file),
        store_timeout_s=store_settings.etcd_timeout_s,
        telemetry=telemetry,
        peer_tls=PeerTlsSettings(),
        share_port=worker is not None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    print(f"registry listening on {app.address}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await app.stop()
    await store.close()
    telemetry.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge_services.registry",
        description=HELP,
        epilog=help_text("environment (KVBRIDGE_REGISTRY_*: registry; KVBRIDGE_*: store and server):", SETTINGS)
        + _TELEMETRY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(WORKER_FLAG, type=int, default=None, dest="worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=ServerSettings().log_level.upper(), format="%(asctime)s %(levelname)s %(process)d %(name)s %(message)s"
    )
    settings = _settings()
    if args.worker is None and settings.serve_processes > 1:
        problem = _multi_process_problem(settings, StoreSettings())
        if problem:
            parser.error(problem)
        # Each worker prints its own "registry listening" line once it serves.
        log.info(
            "registry: %d server processes on %s:%d", settings.serve_processes, ServerSettings().host, settings.port
        )
        return supervise(settings.serve_processes)
    asyncio.run(_serve(args.worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
