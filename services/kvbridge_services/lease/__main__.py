"""Composition root: ``python -m kvbridge_services.lease`` (settings from KVBRIDGE_* env, flags override).

Settings come from KVBRIDGE_* (store, server) and KVBRIDGE_LEASE_* (policy) variables.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbridge_services.common import entrypoint
from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings, StoreSettings, check_bind
from kvbridge_services.common.keys import KeyLayout
from kvbridge_services.common.settings_doc import SettingsModels
from kvbridge_services.common.telemetry import Telemetry

from .app import LeaseApp
from .policy import LeasePolicy

log = logging.getLogger("kvbridge_services.lease")
# /metrics is on unless KVBRIDGE_LEASE_METRICS_PORT says otherwise (0 turns it off).
DEFAULT_METRICS_PORT = 9152

HELP = "kvbridge lease manager: heartbeat-renewed leases on decode-held KV (gRPC LeaseService)."
# Every setting this process reads (--help and docs/settings.md are made from these).
SETTINGS: SettingsModels = (
    (LeasePolicy, {"metrics_port": f"{DEFAULT_METRICS_PORT} (0: off)"}),
    (StoreSettings, None),
    (ServerSettings, None),
)


@dataclass(frozen=True)
class _Config:
    policy: LeasePolicy
    store: StoreSettings
    server: ServerSettings
    auth: Authenticator
    data_dir: Path | None


def _load(args: argparse.Namespace) -> _Config:
    server = ServerSettings(**entrypoint.overrides(args, {"host": "host"}))
    policy = LeasePolicy(**entrypoint.overrides(args, {"port": "port"}))
    if "metrics_port" not in policy.model_fields_set:
        policy = policy.model_copy(update={"metrics_port": DEFAULT_METRICS_PORT})
    store = StoreSettings()
    check_bind(server.host, secured=server.api_keys_file is not None, insecure=server.insecure, what="gRPC server")
    # Its ports free and bindable, etcd answering: else one line and the exit code (common/entrypoint.py).
    entrypoint.check_ports(
        [
            entrypoint.Port(server.host, policy.port, "KVBRIDGE_LEASE_PORT", flag="--port"),
            entrypoint.Port(server.host, policy.metrics_port, "KVBRIDGE_LEASE_METRICS_PORT"),
        ]
    )
    entrypoint.check_store(store)
    return _Config(policy, store, server, Authenticator.from_file(server.api_keys_file), args.data_dir)


_GC_FREEZE_EVERY_S = 10.0


async def _freeze_long_lived_objects() -> None:
    """Keep full garbage collections short: with 100k leases a full collection walks every record
    (~0.5 s here, seconds on a loaded host: expiries late, the leader key not refreshed). Objects
    that survived the young collections are moved out of the collector's sight every few seconds;
    lease records hold no reference cycles, so reference counting still frees them when they end."""
    while True:
        await asyncio.sleep(_GC_FREEZE_EVERY_S)
        gc.collect(1)
        gc.freeze()


async def _serve(cfg: _Config) -> None:
    telemetry = Telemetry.from_env("kvbridge-lease")
    try:
        store = await entrypoint.open_checked_store(cfg.store, data_dir=cfg.data_dir, log=log)
        app = LeaseApp(
            store, cfg.policy, cfg.server, auth=cfg.auth, keys=KeyLayout(cfg.store.etcd_prefix), telemetry=telemetry
        )
        freezer = asyncio.create_task(_freeze_long_lived_objects())
        await app.start()
        log.info("lease manager listening on %s (waiting for leadership)", app.address)
        await entrypoint.wait_for_stop()
        log.info("shutting down")
        freezer.cancel()
        await app.stop(cfg.server.shutdown_grace_s)
        await store.close()
    finally:
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = entrypoint.parser(
        module="kvbridge_services.lease",
        description=HELP,
        env_heading="environment (KVBRIDGE_LEASE_*: lease policy; KVBRIDGE_*: store and server):",
        settings=SETTINGS,
        service_name="kvbridge-lease",
    )
    entrypoint.add_bind_flags(parser, ports={"--port": "gRPC port (overrides KVBRIDGE_LEASE_PORT; default 50052)"})
    entrypoint.add_data_dir_flag(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def load() -> _Config:
        cfg = _load(args)
        entrypoint.configure_logging(cfg.server.log_level)
        return cfg

    return entrypoint.run(
        load,
        _serve,
        settings=SETTINGS,
        config_file=args.config,
        flags=entrypoint.given_flags(args, {"host": "--host", "port": "--port"}),
    )


if __name__ == "__main__":
    sys.exit(main())
