"""Composition root: ``python -m kvbridge_services.gateway`` (settings from KVBRIDGE_GATEWAY_* env)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from kvbridge_services.common.config import PeerTlsSettings, ServerSettings
from kvbridge_services.common.settings_doc import NOT_READ, SettingsModels, help_text
from kvbridge_services.common.telemetry import Telemetry

from .app import GatewayApp
from .config import GatewaySettings

_HELP = """KV-cache-aware gateway for P/D-disaggregated vLLM (OpenAI HTTP + gRPC front doors).

Settings come from the environment (listed below with their defaults); flags override them. A secure stack
needs three: KVBRIDGE_API_KEYS_FILE (client and service keys; unset: insecure development mode, loopback only
unless KVBRIDGE_INSECURE=1), KVBRIDGE_API_KEY (the service key presented to the registry and lease manager)
and KVBRIDGE_HASH_SECRET (hex, shared with every connector). Engines: registered by their connectors (the
registry's list), or KVBRIDGE_GATEWAY_PREFILL_ENGINES / _DECODE_ENGINES. docs/gateway.md, docs/settings.md."""
_TELEMETRY_HELP = """

telemetry:
  OTEL_EXPORTER_OTLP_ENDPOINT    OTLP/gRPC trace collector, e.g. http://jaeger:4317 (unset: tracing off);
                                 OTEL_SERVICE_NAME (default kvbridge-gateway) and the other OTEL_* apply
  KVBRIDGE_TELEMETRY_HASH_KEY_HEX key hashing tenant/conversation span attributes (share it across services)
  Metrics: GET /metrics on the HTTP port."""
# Every setting this process reads (--help and docs/settings.md are made from these). The gRPC front door takes
# the common server settings but the gateway's own bind address, log level and keys file.
SETTINGS: SettingsModels = (
    (GatewaySettings, None),
    (ServerSettings, {"host": NOT_READ, "log_level": NOT_READ, "api_keys_file": NOT_READ}),
    (PeerTlsSettings, None),
)


async def _serve(settings: GatewaySettings) -> None:
    telemetry = Telemetry.from_env("kvbridge-gateway")
    app = GatewayApp(settings, telemetry=telemetry, peer_tls=PeerTlsSettings())
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await app.stop()
    telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge_services.gateway",
        description=_HELP,
        epilog=help_text("environment (KVBRIDGE_GATEWAY_*: gateway; KVBRIDGE_*: stack-wide):", SETTINGS)
        + _TELEMETRY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--http-port", type=int, help="HTTP port (default 8080)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 50053)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in (("http_port", args.http_port), ("grpc_port", args.grpc_port), ("host", args.host))
        if v is not None
    }
    settings = GatewaySettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
