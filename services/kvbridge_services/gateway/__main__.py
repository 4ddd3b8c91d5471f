"""Composition root: ``python -m kvbridge_services.gateway`` (settings from KVBRIDGE_GATEWAY_* env)."""

from __future__ import annotations

import sys

from kvbridge_services.common import entrypoint
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings, check_bind
from kvbridge_services.common.settings_doc import NOT_READ, SettingsModels
from kvbridge_services.common.telemetry import Telemetry

from .app import GatewayApp
from .config import GatewaySettings
from .staticengines import StaticEngineError

_HELP = """KV-cache-aware gateway for P/D-disaggregated vLLM (OpenAI HTTP + gRPC front doors).

Settings come from the environment (listed below with their defaults), beneath it a --config file of the
same names; flags override both. A secure stack
needs three: KVBRIDGE_API_KEYS_FILE (client and service keys; unset: insecure development mode, loopback only
unless KVBRIDGE_INSECURE=1), KVBRIDGE_API_KEY (the service key presented to the registry and lease manager)
and KVBRIDGE_HASH_SECRET (hex, shared with every connector). Engines: registered by their connectors (the
registry's list), or stock vLLM engines by URL in KVBRIDGE_GATEWAY_PREFILL_ENGINES / _DECODE_ENGINES, which
the gateway registers itself. docs/gateway.md, docs/settings.md."""
# Every setting this process reads (--help and docs/settings.md are made from these). The gRPC front door takes
# the common server settings but the gateway's own bind address, log level and keys file.
SETTINGS: SettingsModels = (
    (GatewaySettings, None),
    (ServerSettings, {"host": NOT_READ, "log_level": NOT_READ, "api_keys_file": NOT_READ}),
    (PeerTlsSettings, None),
)


async def _serve(settings: GatewaySettings) -> None:
    telemetry = Telemetry.from_env("kvbridge-gateway")
    try:
        app = GatewayApp(settings, telemetry=telemetry, peer_tls=PeerTlsSettings())
        try:
            await app.start()
        except StaticEngineError as exc:  # an engine given by URL states too little to register it: one line
            await app.core.stop()
            raise SystemExit(entrypoint.bad_config(exc)) from None
        await entrypoint.wait_for_stop()
        await app.stop()
    finally:
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = entrypoint.parser(
        module="kvbridge_services.gateway",
        description=_HELP,
        env_heading="environment (KVBRIDGE_GATEWAY_*: gateway; KVBRIDGE_*: stack-wide):",
        settings=SETTINGS,
        service_name="kvbridge-gateway",
        metrics="Metrics: GET /metrics on the HTTP port.",
    )
    entrypoint.add_bind_flags(
        parser,
        ports={
            "--http-port": "HTTP port (overrides KVBRIDGE_GATEWAY_HTTP_PORT; default 8080)",
            "--grpc-port": "gRPC port (overrides KVBRIDGE_GATEWAY_GRPC_PORT; default 50053)",
        },
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def load() -> GatewaySettings:
        settings = GatewaySettings(
            **entrypoint.overrides(args, {"host": "host", "http_port": "http_port", "grpc_port": "grpc_port"})
        )
        server = ServerSettings()  # the gRPC door's limits: refused here, as one line, not while starting
        PeerTlsSettings()
        secured = settings.api_keys_file is not None
        check_bind(settings.host, secured=secured, insecure=server.insecure, what="gateway")
        host = "KVBRIDGE_GATEWAY_HOST"
        entrypoint.check_ports(
            [
                entrypoint.Port(settings.host, settings.http_port, "KVBRIDGE_GATEWAY_HTTP_PORT", host, "--http-port"),
                entrypoint.Port(settings.host, settings.grpc_port, "KVBRIDGE_GATEWAY_GRPC_PORT", host, "--grpc-port"),
            ]
        )
        entrypoint.configure_logging(settings.log_level)
        return settings

    flags = {"host": "--host", "http_port": "--http-port", "grpc_port": "--grpc-port"}
    return entrypoint.run(
        load, _serve, settings=SETTINGS, config_file=args.config, flags=entrypoint.given_flags(args, flags)
    )


if __name__ == "__main__":
    sys.exit(main())
