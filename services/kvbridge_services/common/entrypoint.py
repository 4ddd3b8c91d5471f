"""What the three service entry points (``python -m kvbridge_services.{registry,lease,gateway}``) share, so
they behave one way: the same ``--help`` layout (every setting from the settings models, then telemetry),
the same flags for the same things, a bad configuration as one line on stderr and exit code 2, a store that
cannot open (a damaged or locked ``--data-dir``) as one line and exit code 1, one log format, and
SIGTERM/SIGINT as a graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from .config import StoreSettings
from .settings_doc import SettingsModels, help_text
from .store import Store, StoreError, open_store
from .store.etcd import EtcdTlsError
from .store.wal import StoreOpenError

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG = 0, 1, 2

LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"

T = TypeVar("T")


def _telemetry_help(service_name: str, extra: str) -> str:
    return f"""

telemetry:
  OTEL_EXPORTER_OTLP_ENDPOINT    OTLP/gRPC trace collector, e.g. http://jaeger:4317 (unset: tracing off);
                                 OTEL_SERVICE_NAME (default {service_name}) and the other OTEL_* apply
  KVBRIDGE_TELEMETRY_HASH_KEY_HEX key hashing tenant/conversation span attributes (share it across services)""" + (
        f"\n  {extra}" if extra else ""
    )


def parser(
    *, module: str, description: str, env_heading: str, settings: SettingsModels, service_name: str, metrics: str = ""
) -> argparse.ArgumentParser:
    """``--help``: ``description``, then every setting of ``settings`` under ``env_heading``, then telemetry.
    Flags are added by the caller with :func:`add_bind_flags` / :func:`add_data_dir_flag` (one spelling each)."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=description,
        epilog=help_text(env_heading, settings) + _telemetry_help(service_name, metrics),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_bind_flags(p: argparse.ArgumentParser, *, ports: dict[str, str]) -> None:
    """``--host`` and one flag per listening port (``ports``: flag → help); each overrides its variable."""
    p.add_argument("--host", help="bind address (overrides the environment; default 127.0.0.1)")
    for flag, text in ports.items():
        p.add_argument(flag, type=int, help=text)


def add_data_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="embedded store only (no KVBRIDGE_ETCD_ENDPOINTS): directory of its write-ahead log "
        "(default: memory only). Services started separately share a store only through etcd.",
    )


def overrides(args: argparse.Namespace, names: dict[str, str]) -> dict[str, Any]:
    """The flags given, as settings fields (``names``: argparse dest → field name)."""
    return {field: getattr(args, dest) for dest, field in names.items() if getattr(args, dest, None) is not None}


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def open_checked_store(settings: StoreSettings, *, data_dir: Path | None, log: logging.Logger) -> Store:
    """The configured store; fails at start when etcd refuses our TLS material (EtcdTlsError). A store that is
    merely down is waited for by the service, as it would be later."""
    if settings.embedded:
        where = f"write-ahead log in {data_dir}" if data_dir else "memory only, not durable"
        log.warning("no KVBRIDGE_ETCD_ENDPOINTS: embedded store (%s; not shared with other processes)", where)
    store = open_store(settings, data_dir=data_dir)
    try:
        await store.current_revision(timeout=settings.etcd_timeout_s)
    except EtcdTlsError:
        await store.close()
        raise
    except StoreError as exc:
        log.warning("store not reachable at start (%s); going on", exc)
    return store


async def wait_for_stop() -> None:
    """Returns on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def bad_config(problem: object) -> int:
    """A configuration the service refuses: one line on stderr; the exit code."""
    print(f"invalid configuration: {problem}", file=sys.stderr)
    return EXIT_BAD_CONFIG


def run(load: Callable[[], T], serve: Callable[[T], Coroutine[Any, Any, None]]) -> int:
    """Loads and validates the configuration (``load``), then serves it until a stop signal; the exit code."""
    try:
        config = load()
    except (ValidationError, ValueError) as exc:
        return bad_config(exc)
    try:
        asyncio.run(serve(config))
    except EtcdTlsError as exc:  # etcd refused our TLS material: a configuration error, found at start
        return bad_config(exc)
    except StoreOpenError as exc:  # a damaged or locked --data-dir: say what and how to repair, no traceback
        print(f"cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
