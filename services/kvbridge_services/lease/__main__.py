"""Composition root: ``python -m kvbridge_services.lease``.

The only place that reads the environment and configures logging. Settings come
from KVBRIDGE_* (store, server) and KVBRIDGE_LEASE_* (policy) variables.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from ..common.auth import Authenticator
from ..common.config import ServerSettings, StoreSettings
from ..common.keys import KeyLayout
from ..common.settings_doc import SettingsModels, help_text
from ..common.store import Store, StoreError, open_store
from ..common.store.etcd import EtcdTlsError
from ..common.store.wal import StoreOpenError
from ..common.telemetry import Telemetry
from .app import LeaseApp
from .policy import LeasePolicy

log = logging.getLogger("kvbridge_services.lease")
# /metrics is on unless KVBRIDGE_LEASE_METRICS_PORT says otherwise (0 turns it off).
DEFAULT_METRICS_PORT = 9152

_TELEMETRY_HELP = """

telemetry:
  OTEL_EXPORTER_OTLP_ENDPOINT    OTLP/gRPC trace collector, e.g. http://jaeger:4317 (unset: tracing off);
                                 OTEL_SERVICE_NAME (default kvbridge-lease) and the other OTEL_* apply
  KVBRIDGE_TELEMETRY_HASH_KEY_HEX key hashing tenant/conversation span attributes (share it across services)"""


# Every setting this process reads (--help and docs/settings.md are made from these).
SETTINGS: SettingsModels = (
    (LeasePolicy, {"metrics_port": f"{DEFAULT_METRICS_PORT} (0: off)"}),
    (StoreSettings, None),
    (ServerSettings, None),
)


def _settings_help() -> str:
    return help_text("environment (KVBRIDGE_LEASE_*: lease policy; KVBRIDGE_*: store and server):", SETTINGS) + (
        _TELEMETRY_HELP
    )


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge_services.lease",
        description="kvbridge lease manager: heartbeat-renewed leases on decode-held KV (gRPC LeaseService).",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="embedded store only: directory of its write-ahead log (default: memory only)",
    )
    return parser.parse_args(argv)


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


async def _serve(app: LeaseApp, grace_s: float) -> None:
    stop = asyncio.Event()
    freezer = asyncio.create_task(_freeze_long_lived_objects())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    log.info("lease manager listening on %s (waiting for leadership)", app.address)
    await stop.wait()
    log.info("shutting down")
    freezer.cancel()
    await app.stop(grace_s)
    await app.store.close()


async def _check_store(store: Store, timeout_s: float) -> None:
    """Fail at start when etcd refuses our TLS material; a store that is merely down is waited for by the
    election, as before."""
    try:
        await store.current_revision(timeout=timeout_s)
    except EtcdTlsError:
        await store.close()
        raise
    except StoreError as exc:
        log.warning("store not reachable at start (%s); campaigning anyway", exc)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        store_settings = StoreSettings()
        server_settings = ServerSettings()
        policy = LeasePolicy()
        if "metrics_port" not in policy.model_fields_set:
            policy = policy.model_copy(update={"metrics_port": DEFAULT_METRICS_PORT})
        auth = Authenticator.from_file(server_settings.api_keys_file)
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    telemetry = Telemetry.from_env("kvbridge-lease")

    async def run() -> None:
        store = open_store(store_settings, data_dir=args.data_dir)
        await _check_store(store, store_settings.etcd_timeout_s)
        app = LeaseApp(
            store, policy, server_settings, auth=auth, keys=KeyLayout(store_settings.etcd_prefix), telemetry=telemetry
        )
        await _serve(app, server_settings.shutdown_grace_s)

    try:
        asyncio.run(run())
    except EtcdTlsError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    except StoreOpenError as exc:  # a damaged or locked --data-dir: say what and how to repair, no traceback
        print(f"cannot start: {exc}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
