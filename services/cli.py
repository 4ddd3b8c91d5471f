"""The ``kvbridge`` command line: run the local stack, the demo, and inspect state.

Exit codes: 0 success, 1 failure talking to the services (typed error printed),
2 bad arguments (argparse), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from kvbridge.errors import KvbridgeError
from kvbridge.sdk import ClientOptions, LeaseClient, RegistryClient
from kvbridge.types.v1 import types_pb2

DEFAULT_REGISTRY = os.environ.get("KVBRIDGE_REGISTRY_ADDRESS", "127.0.0.1:50051")
DEFAULT_LEASE = os.environ.get("KVBRIDGE_LEASE_ADDRESS", "127.0.0.1:50052")


def _progress(msg: str) -> None:
    print(f"[kvbridge] {msg}", file=sys.stderr, flush=True)


def _stack_config(args: argparse.Namespace) -> Any:
    from kvbridge_services.common.config import ServerSettings, StoreSettings
    from kvbridge_services.stack import StackConfig

    store = StoreSettings()
    if args.etcd:
        store = store.model_copy(update={"etcd_endpoints": StoreSettings(etcd_endpoints=args.etcd).etcd_endpoints})
    gateway = None
    if getattr(args, "gateway", False):
        from kvbridge_services.gateway.config import GatewaySettings

        gateway = GatewaySettings(http_port=args.gateway_http_port, grpc_port=args.gateway_grpc_port)
    return StackConfig(
        store=store,
        server=ServerSettings(),
        data_dir=Path(args.data_dir) if getattr(args, "data_dir", None) else None,
        registry_port=args.registry_port,
        lease_port=args.lease_port,
        gateway=gateway,
    )


async def _up(args: argparse.Namespace) -> int:
    from kvbridge_services.stack import Stack

    stack = Stack(_stack_config(args), progress=_progress)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stack.start()
        _progress("stack is up; Ctrl-C stops it")
        await stop.wait()
    finally:
        _progress("stopping")
        await stack.stop()
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from kvbridge_services.demo import run_demo
    from kvbridge_services.stack import Stack

    args.registry_port = args.registry_port or 0
    args.lease_port = args.lease_port or 0
    stack = Stack(_stack_config(args), progress=_progress)
    try:
        await stack.start()
        assert stack.registry is not None and stack.lease is not None
        _progress("running a multi-turn conversation (control plane only: a simulated decode engine)")
        await run_demo(stack.registry.address, stack.lease.address, as_json=args.json)
    finally:
        await stack.stop()
    return 0


def _opts(args: argparse.Namespace) -> ClientOptions:
    return ClientOptions(api_key=args.api_key or os.environ.get("KVBRIDGE_API_KEY"), timeout_s=args.timeout)


def _emit(args: argparse.Namespace, messages: Sequence[Message], columns: list[tuple[str, str]]) -> None:
    rows = [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in messages]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("  ".join(f"{title:<{w}}" for title, w in ((c[0], 18) for c in columns)))
    for row in rows:
        cells = []
        for _, path in columns:
            value: Any = row
            for part in path.split("."):
                value = value.get(part, "") if isinstance(value, dict) else ""
            cells.append(f"{value!s:<18}")
        print("  ".join(cells))


async def _inspect(args: argparse.Namespace) -> int:
    opts = _opts(args)
    cmd = args.command
    if cmd in ("engines", "conversations", "status"):
        async with RegistryClient(args.registry, opts) as reg:
            if cmd == "status":
                engines = await reg.list_engines(page_size=1000)
                entries = await reg.list_entries(tenant=args.tenant, page_size=1000)
                async with LeaseClient(args.lease, opts) as lc:
                    leases = await lc.list_leases(tenant=args.tenant, page_size=1000)
                status = {"registry": args.registry, "lease": args.lease, "engines": len(engines.engines),
                          "entries": len(entries.entries), "leases": len(leases.leases)}
                print(json.dumps(status, indent=None if not args.json else 2))
            elif cmd == "engines":
                resp = await reg.list_engines(model=args.model, page_size=args.limit)
                _emit(args, list(resp.engines), [("ENGINE", "engine_id"), ("ROLE", "role"), ("MODEL", "model"),
                                                 ("KV", "kv_host"), ("NODE LEASE", "node_lease_id")])
            elif args.action == "ls":
                resp2 = await reg.list_entries(tenant=args.tenant, model=args.model, page_size=args.limit)
                _emit(args, list(resp2.entries), [("TENANT", "key.tenant"), ("CONVERSATION", "key.conversation_key"),
                                                  ("TOKENS", "token_count"), ("ENGINE", "engine_id"),
                                                  ("EPOCH", "epoch"), ("LEASE", "lease_id")])
            elif args.action == "show":
                entry = await reg.get_entry(args.tenant, args.model, args.key)
                print(json_format.MessageToJson(entry, preserving_proto_field_name=True))
            else:  # evict
                entry = await reg.delete_entry(args.tenant, args.model, args.key, types_pb2.REVOKE_REASON_OPERATOR)
                print(f"evicted {args.key} (epoch {entry.epoch}, lease {entry.lease_id})")
        return 0
    async with LeaseClient(args.lease, opts) as lc:
        if args.action == "ls":
            resp3 = await lc.list_leases(tenant=args.tenant, engine_id=args.engine, page_size=args.limit)
            _emit(args, list(resp3.leases), [("LEASE", "lease_id"), ("KIND", "kind"), ("TENANT", "tenant"),
                                              ("ENGINE", "engine_id"), ("CONVERSATION", "conversation_key"),
                                              ("DEADLINE", "deadline")])
        else:
            lease = await lc.revoke(args.lease_id, types_pb2.REVOKE_REASON_OPERATOR)
            print(f"revoked lease {lease.lease_id}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge", description="kvbridge: verified decode→prefill KV reuse for vLLM.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def stack_flags(sp: argparse.ArgumentParser, default_ports: bool) -> None:
        sp.add_argument("--etcd", default="", help="etcd endpoints host:port,... (default: embedded store)")
        sp.add_argument("--data-dir", default=None, help="embedded store: directory for its durable log")
        sp.add_argument("--registry-port", type=int, default=50051 if default_ports else 0)
        sp.add_argument("--lease-port", type=int, default=50052 if default_ports else 0)

    up = sub.add_parser("up", help="run the local stack (lease manager, registry, gateway) until Ctrl-C")
    stack_flags(up, True)
    up.add_argument("--no-gateway", dest="gateway", action="store_false", help="run without the gateway")
    up.add_argument("--gateway-http-port", type=int, default=8080)
    up.add_argument("--gateway-grpc-port", type=int, default=50053)

    demo = sub.add_parser("demo", help="start the stack in-process and run a multi-turn reuse demo")
    stack_flags(demo, False)
    demo.add_argument("--json", action="store_true", help="print the per-turn report as JSON")

    def client_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--registry", default=DEFAULT_REGISTRY, help="registry address (env KVBRIDGE_REGISTRY_ADDRESS)")
        sp.add_argument("--lease", default=DEFAULT_LEASE, help="lease manager address (env KVBRIDGE_LEASE_ADDRESS)")
        sp.add_argument("--api-key", default=None, help="API key (env KVBRIDGE_API_KEY)")
        sp.add_argument("--timeout", type=float, default=5.0, help="per-call deadline, seconds")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("--tenant", default="", help="tenant (service principals must name one)")
        sp.add_argument("--model", default="")
        sp.add_argument("--limit", type=int, default=100, help="rows per page (1..1000)")

    st = sub.add_parser("status", help="counts of engines, entries and leases")
    client_flags(st)
    en = sub.add_parser("engines", help="registered engines")
    en.add_argument("action", choices=["ls"])
    client_flags(en)
    cv = sub.add_parser("conversations", help="registry entries: ls | show KEY | evict KEY")
    cv.add_argument("action", choices=["ls", "show", "evict"])
    cv.add_argument("key", nargs="?", default="", help="conversation key (show, evict)")
    client_flags(cv)
    ls = sub.add_parser("leases", help="leases: ls | revoke LEASE_ID")
    ls.add_argument("action", choices=["ls", "revoke"])
    ls.add_argument("lease_id", nargs="?", type=int, default=0)
    ls.add_argument("--engine", default="")
    client_flags(ls)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "conversations" and args.action in ("show", "evict") and not args.key:
        parser.error(f"conversations {args.action} needs a conversation KEY")
    if args.command == "leases" and args.action == "revoke" and args.lease_id <= 0:
        parser.error("leases revoke needs a positive LEASE_ID")
    logging.basicConfig(level=os.environ.get("KVBRIDGE_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    runner = {"up": _up, "demo": _demo}.get(args.command, _inspect)
    try:
        return asyncio.run(runner(args))
    except KvbridgeError as exc:
        print(f"kvbridge: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
