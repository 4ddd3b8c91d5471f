"""Composition root: ``python -m kvbridge_services.gateway`` (settings from KVBRIDGE_GATEWAY_* env)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from kvbridge_services.common.config import PeerTlsSettings
from kvbridge_services.common.telemetry import Telemetry

from .app import GatewayApp
from .config import GatewaySettings

_HELP = """KV-cache-aware gateway for P/D-disaggregated vLLM (OpenAI HTTP + gRPC front doors).

Settings come from KVBRIDGE_GATEWAY_* environment variables (and the stack-wide KVBRIDGE_API_KEYS_FILE,
KVBRIDGE_API_KEY, KVBRIDGE_HASH_SECRET, KVBRIDGE_INSECURE), e.g.
  KVBRIDGE_GATEWAY_HTTP_PORT=8080 KVBRIDGE_GATEWAY_GRPC_PORT=50053
  KVBRIDGE_GATEWAY_REGISTRY_ADDRESS=127.0.0.1:50051 KVBRIDGE_GATEWAY_LEASE_ADDRESS=127.0.0.1:50052
  KVBRIDGE_GATEWAY_REGISTRY_CONNECTIONS=1 (more: spread lookups over a registry's server processes)
  KVBRIDGE_GATEWAY_PREFILL_ENGINES=http://p0:8000  KVBRIDGE_GATEWAY_DECODE_ENGINES=http://d0:8000
    (or a JSON list of {"url", "model", "engine_id", "kv_host", "kv_port", "block_size", "register_in_registry"})
  KVBRIDGE_API_KEYS_FILE=keys.json (client and service keys; unset: insecure dev mode, loopback only unless
    KVBRIDGE_INSECURE=1; older name KVBRIDGE_GATEWAY_API_KEYS_FILE)
  KVBRIDGE_API_KEY=<service key> presented to registry and lease manager (override:
    KVBRIDGE_GATEWAY_CONTROL_API_KEY)
  KVBRIDGE_HASH_SECRET=<32..128 hex digits> the deployment secret shared with every connector; required with
    API keys (`openssl rand -hex 32`; older name KVBRIDGE_GATEWAY_HASH_SECRET_HEX)
  KVBRIDGE_GATEWAY_REUSE_THRESHOLD_TOKENS=64  KVBRIDGE_GATEWAY_COMPAT_REGISTRATION=true
  KVBRIDGE_GATEWAY_TOKENIZERS='{"<model>": "/path/to/model"}'  (tokenize in-process with the model's HF
    tokenizer + chat template instead of P's /tokenize; see docs/gateway.md, "Tokenization")
  KVBRIDGE_GATEWAY_TOKENIZER_PREFIX_CACHE_MB=256 (a conversation's next turn encodes only its new text; 0: off)
  KVBRIDGE_GATEWAY_ENTRY_MIRROR=true  KVBRIDGE_GATEWAY_ENTRY_MIRROR_MAX_ENTRIES=50000
    (keyed lookups answered from a WatchEntries-fed copy of the registry's entries; docs/gateway.md, "Lookups")
TLS: KVBRIDGE_TLS_CERT_FILE/_KEY_FILE (+ _CLIENT_CA_FILE: mTLS) for the gRPC front door; towards the registry
  and lease manager KVBRIDGE_PEER_CA_FILE (+ KVBRIDGE_PEER_CERT_FILE/_KEY_FILE: mTLS, _SERVER_NAME).
Tracing: OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4317 (OTLP/gRPC; off when unset), OTEL_SERVICE_NAME,
  KVBRIDGE_TELEMETRY_HASH_KEY_HEX (key hashing tenant/conversation span attributes). Metrics: GET /metrics.
Flags below override the environment."""


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
