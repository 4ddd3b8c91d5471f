"""Composition root: ``python -m kvbridge_services.registry`` (settings from KVBRIDGE_* env, flags override)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbridge_services.common import entrypoint
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings, StoreSettings, check_bind
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.settings_doc import SettingsModels
from kvbridge_services.common.telemetry import Telemetry

from .app import RegistryApp
from .config import RegistrySettings
from .workers import WORKER_FLAG, supervise

log = logging.getLogger("kvbridge_services.registry")
# /metrics is on unless KVBRIDGE_REGISTRY_METRICS_PORT says otherwise (0 turns it off).
DEFAULT_METRICS_PORT = 9151

HELP = "kvbridge metadata registry (gRPC kvbridge.registry.v1.RegistryService)."
# Every setting this process reads (--help and docs/settings.md are made from these).
SETTINGS: SettingsModels = (
    (RegistrySettings, {"metrics_port": f"{DEFAULT_METRICS_PORT} (0: off)"}),
    (StoreSettings, None),
    (ServerSettings, None),
    (PeerTlsSettings, None),
)


@dataclass(frozen=True)
class _Config:
    registry: RegistrySettings
    store: StoreSettings
    server: ServerSettings
    auth: Authenticator
    data_dir: Path | None
    worker: int | None  # this process's index among serve_processes processes sharing the port


def _load(args: argparse.Namespace) -> _Config:
    server = ServerSettings(**entrypoint.overrides(args, {"host": "host"}))
    registry = RegistrySettings(**entrypoint.overrides(args, {"port": "port"}))
    if "metrics_port" not in registry.model_fields_set:
        registry = registry.model_copy(update={"metrics_port": DEFAULT_METRICS_PORT})
    if args.worker is not None and registry.metrics_port:
        registry = registry.model_copy(update={"metrics_port": registry.metrics_port + args.worker})
    store = StoreSettings()
    check_bind(server.host, secured=server.api_keys_file is not None, insecure=server.insecure, what="gRPC server")
    if args.worker is None:  # workers share the port their supervisor checked
        # Its ports free and bindable, etcd answering: else one line and the exit code (common/entrypoint.py).
        entrypoint.check_ports(
            [
                entrypoint.Port(server.host, registry.port, "KVBRIDGE_REGISTRY_PORT", flag="--port"),
                entrypoint.Port(server.host, registry.metrics_port, "KVBRIDGE_REGISTRY_METRICS_PORT"),
            ]
        )
        if registry.serve_processes > 1:
            problem = _multi_process_problem(store, registry)
            if problem:
                raise ValueError(problem)
        entrypoint.check_store(store)
    return _Config(registry, store, server, Authenticator.from_file(server.api_keys_file), args.data_dir, args.worker)


def _multi_process_problem(store: StoreSettings, registry: RegistrySettings) -> str | None:
    if store.embedded:
        return (
            "KVBRIDGE_REGISTRY_SERVE_PROCESSES > 1 needs etcd (KVBRIDGE_ETCD_ENDPOINTS): the embedded "
            "in-process store cannot be shared between processes"
        )
    if registry.port == 0:
        return "KVBRIDGE_REGISTRY_SERVE_PROCESSES > 1 needs a fixed KVBRIDGE_REGISTRY_PORT, not 0"
    return None


async def _serve(cfg: _Config) -> None:
    """One server process (of serve_processes sharing the port, or the only one)."""
    telemetry = Telemetry.from_env("kvbridge-registry")
    try:
        store = await entrypoint.open_checked_store(cfg.store, data_dir=cfg.data_dir, log=log)
        app = RegistryApp(
            store,
            settings=cfg.registry,
            server_settings=cfg.server,
            keys=KeyLayout(cfg.store.etcd_prefix),
            auth=cfg.auth,
            store_timeout_s=cfg.store.etcd_timeout_s,
            telemetry=telemetry,
            peer_tls=PeerTlsSettings(),
            share_port=cfg.worker is not None,
        )
        await app.start()
        print(f"registry listening on {app.address}", flush=True)
        await entrypoint.wait_for_stop()
        log.info("shutting down")
        await app.stop(cfg.server.shutdown_grace_s)
        await store.close()
    finally:
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = entrypoint.parser(
        module="kvbridge_services.registry",
        description=HELP,
        env_heading="environment (KVBRIDGE_REGISTRY_*: registry; KVBRIDGE_*: store and server):",
        settings=SETTINGS,
        service_name="kvbridge-registry",
    )
    entrypoint.add_bind_flags(parser, ports={"--port": "gRPC port (overrides KVBRIDGE_REGISTRY_PORT; default 50051)"})
    entrypoint.add_data_dir_flag(parser)
    parser.add_argument(WORKER_FLAG, type=int, default=None, dest="worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def load() -> _Config:
        cfg = _load(args)
        entrypoint.configure_logging(cfg.server.log_level)
        return cfg

    loaded = entrypoint.load(
        load,
        settings=SETTINGS,
        config_file=args.config,
        flags=entrypoint.given_flags(args, {"host": "--host", "port": "--port"}),
    )
    cfg = loaded.config
    if cfg is None:
        return loaded.code
    if cfg.worker is None and cfg.registry.serve_processes > 1:
        # Each worker prints its own "registry listening" line once it serves; flags go to every worker.
        log.info(
            "registry: %d server processes on %s:%d", cfg.registry.serve_processes, cfg.server.host, cfg.registry.port
        )
        return supervise(cfg.registry.serve_processes, argv)
    return entrypoint.serve(cfg, _serve, SETTINGS)


if __name__ == "__main__":
    sys.exit(main())
