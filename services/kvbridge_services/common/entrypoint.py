"""What the three service entry points (``python -m kvbridge_services.{registry,lease,gateway}``) share, so
they behave one way: the same ``--help`` layout (every setting from the settings models, then telemetry),
the same flags for the same things (``--config FILE`` on each), every failure to start as one line on stderr
naming the setting or port and the fix: exit code 2 for a configuration (a bad value, an unknown ``KVBRIDGE_*``
name, a bad ``--config`` file), 3 for a port that cannot be bound (busy, or not this machine's address), 4 for
etcd not answering at start, 1 for anything else (a damaged or locked ``--data-dir``); one log format, and
SIGTERM/SIGINT as a graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from .config import StoreSettings
from .configfile import (
    EXIT_BAD_CONFIG,
    EXIT_BIND,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STORE_UNREACHABLE,
    ConfigError,
    Origin,
    Port,
    StartError,
    check_ports,
    explain,
    load_environment,
    store_unreachable,
)
from .settings_doc import SettingsModels, help_text
from .store import Store, StoreError, open_store
from .store.etcd import EtcdTlsError
from .store.wal import StoreOpenError

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_BIND",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_STORE_UNREACHABLE",
    "Port",
    "StartError",
    "check_ports",
]

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
    p = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=description,
        epilog=help_text(env_heading, settings) + _telemetry_help(service_name, metrics) + _EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flag(p)
    return p


_EXIT_HELP = """

exit codes: 0 stopped by SIGTERM/SIGINT; 2 configuration refused (a bad value, an unknown KVBRIDGE_* name, a bad
  --config file or flag); 3 a port cannot be bound (in use, or not this machine's address); 4 etcd did not answer
  within KVBRIDGE_ETCD_START_TIMEOUT_S; 1 anything else. Each is one line on stderr."""


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML file of settings, named as in the environment (KVBRIDGE_...: value); the environment "
        "overrides it, flags override both; unknown names are refused (docs/settings.md)",
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


def given_flags(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, str]:
    """``flags`` (settings field -> flag) limited to those given on the command line, for messages."""
    return {f: flag for f, flag in flags.items() if getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None}


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def wait_for_store(settings: StoreSettings) -> None:
    """Before a service starts: etcd answers within ``etcd_start_timeout_s`` (0: no wait here; the service waits
    for it as it would later), else StartError (exit code 4). EtcdTlsError when etcd refuses our TLS material."""
    if settings.embedded or settings.etcd_start_timeout_s == 0:
        return
    started = time.monotonic()
    deadline = started + settings.etcd_start_timeout_s
    store = open_store(settings)
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                await store.current_revision(timeout=max(0.1, min(settings.etcd_timeout_s, left)))
                return
            except EtcdTlsError:  # configuration, not an outage: no use waiting
                raise
            except StoreError as exc:
                if time.monotonic() + 0.5 >= deadline:
                    reason = str(exc).split(" (")[0][:120] or type(exc).__name__
                    raise store_unreachable(settings.etcd_endpoints, settings.etcd_start_timeout_s, reason) from None
                await asyncio.sleep(0.5)
    finally:
        await store.close()


def check_store(settings: StoreSettings) -> None:
    """:func:`wait_for_store` from synchronous start-up code."""
    if not settings.embedded and settings.etcd_start_timeout_s:
        asyncio.run(wait_for_store(settings))


async def open_checked_store(settings: StoreSettings, *, data_dir: Path | None, log: logging.Logger) -> Store:
    """The configured store; fails at start when etcd refuses our TLS material (EtcdTlsError). A store that goes
    down after the start-up check (:func:`wait_for_store`) is waited for by the service, as it would be later."""
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


def _models(settings: SettingsModels) -> list[type[BaseSettings]]:
    from .telemetry import TelemetrySettings

    return [*(m for m, _ in settings), TelemetrySettings]


@dataclass
class Loaded(Generic[T]):
    """What :func:`load` gives: the configuration, or the exit code of a refused start (already printed)."""

    config: T | None = None
    code: int = EXIT_OK


def load(
    load_fn: Callable[[], T],
    *,
    settings: SettingsModels,
    config_file: Path | None,
    flags: dict[str, str] | None = None,
) -> Loaded[T]:
    """The ``KVBRIDGE_*`` environment checked for unknown names, the ``--config`` file applied beneath it, then
    ``load_fn`` (which builds the settings, checks its ports with :func:`check_ports` and etcd with
    :func:`check_store`). A refusal is printed as one line; ``flags``: field name -> the flag that sets it."""
    models = _models(settings)
    try:
        from_file = load_environment(config_file, models)
    except ConfigError as exc:
        return Loaded(code=bad_config(exc))
    origin = Origin(from_file, config_file, flags)
    try:
        return Loaded(config=load_fn())
    except ValidationError as exc:
        return Loaded(code=bad_config(explain(exc, models, origin)))
    except EtcdTlsError as exc:
        return Loaded(code=bad_config(exc))
    except (ValueError, TypeError) as exc:
        return Loaded(code=bad_config(exc))
    except StartError as exc:
        print(exc, file=sys.stderr)
        return Loaded(code=exc.code)


def serve(config: T, serve_fn: Callable[[T], Coroutine[Any, Any, None]], settings: SettingsModels) -> int:
    """Serves ``config`` until a stop signal; a failure to start as one line; the exit code."""
    try:
        asyncio.run(serve_fn(config))
    except ValidationError as exc:  # a model read while starting (telemetry): named like the others
        return bad_config(explain(exc, _models(settings)))
    except (EtcdTlsError, ValueError) as exc:  # etcd refused our TLS material, a refused bind address or secret
        return bad_config(exc)
    except StoreOpenError as exc:  # a damaged or locked --data-dir: say what and how to repair, no traceback
        print(f"cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except StartError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    except RuntimeError as exc:  # grpc's bind failure, when the port was taken after check_ports
        if "Failed to bind" not in str(exc):
            raise
        print(f"cannot start: {str(exc).split(';')[0]}; stop what holds it or choose another port", file=sys.stderr)
        return EXIT_BIND
    return EXIT_OK


def run(
    load_fn: Callable[[], T],
    serve_fn: Callable[[T], Coroutine[Any, Any, None]],
    *,
    settings: SettingsModels,
    config_file: Path | None,
    flags: dict[str, str] | None = None,
) -> int:
    """:func:`load`, then :func:`serve`; the exit code."""
    loaded = load(load_fn, settings=settings, config_file=config_file, flags=flags)
    if loaded.config is None:
        return loaded.code
    return serve(loaded.config, serve_fn, settings)
