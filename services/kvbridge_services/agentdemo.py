"""``kvbridge demo`` (README command 1): the real stack, two real vLLM CPU engines, an agent conversation.

Starts the lease manager, registry and gateway on the embedded store (etcd with ``--etcd``) in secure mode
(a generated keys file: one service key for gateway, registry and connectors, a tenant key each for
``acme`` and ``globex``), one prefill and one decode vLLM CPU engine with the kvbridge connector (the
``demo`` model shape: 8 layers, hidden 768, random weights), then plays an agent through the stock OpenAI
Python SDK with streaming. Per turn it measures the time to the first content chunk twice: as the turn
runs (the gateway may pull the decode engine's KV) and the same messages again without reuse (a fresh
conversation id and a fresh ``cache_salt``: nothing to look up, every token prefilled).

The model has random weights: it cannot call tools. The demo plays the agent: the assistant turn is
whatever the model answered, then a ``tool`` message with the tool's result is appended, and while the
"tool runs" the client pauses with the conversation held open by the kvbridge SDK's
:class:`~kvbridge.sdk.Conversation` heartbeat (the decode engine's entry lease is shortened to a few
seconds so the pause outlives it: without the heartbeat the KV would be released).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from kvbridge_services.common.tasks import ended_before, stop_on_signals

MODEL = "tiny"  # the launcher's served model name, whatever the shape
OUTPUT_TOKENS = 24
# D's entry lease: shorter than the tool pause, so only the heartbeat keeps the KV across it.
ENTRY_LEASE_TTL_S = 6.0
TOOL_PAUSE_S = 9.0
HEARTBEAT_INTERVAL_S = 2.0
MAX_MODEL_LEN = 2048

Progress = Callable[[str], None]

TOOLS = [
    {
        "name": "search_flights",
        "description": "Search flights between two airports on a date",
        "parameters": {"from": "IATA code", "to": "IATA code", "date": "YYYY-MM-DD", "passengers": "integer"},
    },
    {
        "name": "search_hotels",
        "description": "Hotels in a city with a nightly price ceiling",
        "parameters": {"city": "string", "check_in": "YYYY-MM-DD", "nights": "integer", "max_eur": "number"},
    },
    {
        "name": "get_weather",
        "description": "Daily forecast for a city",
        "parameters": {"city": "string", "days": "integer"},
    },
    {
        "name": "book",
        "description": "Book a flight or hotel offer by id, charging the card on file",
        "parameters": {"offer_id": "string", "confirm": "boolean"},
    },
]


def _filler(topic: str, words: int) -> str:
    """Deterministic prose of ``words`` whitespace tokens (the dev tokenizer is word-level)."""
    base = (
        f"When handling {topic} always check the traveller profile, prefer direct routes, respect the budget, "
        "never book without explicit confirmation, quote prices in euros including taxes and fees, and "
        "explain trade-offs briefly. "
    ).split()
    return " ".join(base[i % len(base)] for i in range(words))


def system_prompt() -> str:
    tools = "\n".join(json.dumps(t, sort_keys=True) for t in TOOLS)
    return (
        "You are a travel agent. You may call these tools by answering with one JSON object "
        '{"tool": NAME, "arguments": {...}} and nothing else:\n'
        + tools
        + "\nPolicies:\n"
        + _filler("travel requests", 560)
    )


def tool_result(name: str, words: int) -> str:
    return json.dumps({"tool": name, "status": "ok"}) + " results: " + _filler(f"{name} results", words)


# -- report ---------------------------------------------------------------------------------------------
@dataclass
class TurnReport:
    turn: str
    tenant: str
    conversation: str  # "" for a content-addressed turn (no conversation id)
    context_tokens: int
    verdict: str  # x-kvbridge-reuse: hit | miss | declined:<reason>
    pulled_tokens: int  # tokens P pulled from D's retained KV (x-kvbridge-reuse tokens=, hits only)
    ttft_reuse_ms: float
    ttft_cold_ms: float
    cold_verdict: str
    expect: str  # what the turn shows
    paused_s: float = 0.0  # client pause before the turn (a tool running), KV held by the heartbeat
    heartbeat_rounds: int = 0  # KeepAlive rounds during that pause

    @property
    def ratio(self) -> float:
        return self.ttft_cold_ms / self.ttft_reuse_ms if self.ttft_reuse_ms > 0 else 0.0


@dataclass
class DemoReport:
    turns: list[TurnReport] = field(default_factory=list)
    engine_start_s: float = 0.0
    total_s: float = 0.0
    png: str = ""
    model_shape: dict[str, Any] = field(default_factory=dict)
    keys_file: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row, turn in zip(out["turns"], self.turns, strict=True):
            row["ratio"] = round(turn.ratio, 2)
        return out


def parse_reuse_header(value: str) -> tuple[str, int]:
    """``hit;tokens=512`` -> ("hit", 512); the verdict and the tokens P pulled (0 unless a hit)."""
    verdict, _, rest = value.partition(";")
    tokens = 0
    for part in rest.split(";"):
        name, _, number = part.partition("=")
        if name.strip() == "tokens" and number.strip().isdigit():
            tokens = int(number)
    return verdict.strip(), tokens if verdict.strip() == "hit" else 0


def format_table(report: DemoReport) -> str:
    head = (
        f"{'turn':<34} {'tenant':<7} {'context':>7} {'pulled':>6} {'verdict':<16} "
        f"{'TTFT reuse':>10} {'TTFT cold':>9} {'cold/reuse':>10}"
    )
    lines = [head, "-" * len(head)]
    for t in report.turns:
        lines.append(
            f"{t.turn:<34} {t.tenant:<7} {t.context_tokens:>7} {t.pulled_tokens:>6} {t.verdict:<16} "
            f"{t.ttft_reuse_ms:>8.0f}ms {t.ttft_cold_ms:>7.0f}ms {t.ratio:>9.2f}x"
        )
    return "\n".join(lines)


def write_png(report: DemoReport, path: Path) -> None:
    """TTFT against context tokens, with reuse and without (the same messages, nothing to pull)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for t in report.turns:  # one turn: its cold TTFT, its TTFT as run, joined
        ax.plot([t.context_tokens] * 2, [t.ttft_cold_ms, t.ttft_reuse_ms], ":", color="tab:gray", linewidth=1)
    ax.scatter(
        [t.context_tokens for t in report.turns],
        [t.ttft_cold_ms for t in report.turns],
        marker="x",
        color="tab:gray",
        label="without reuse (same messages, full prefill)",
    )
    for hit, color, label in (
        (True, "tab:blue", "with kvbridge: hit (KV pulled from decode)"),
        (False, "tab:red", "with kvbridge: miss (nothing to reuse)"),
    ):
        rows = [t for t in report.turns if (t.verdict == "hit") == hit]
        ax.scatter([t.context_tokens for t in rows], [t.ttft_reuse_ms for t in rows], color=color, label=label)
    for t in report.turns:
        ax.annotate(
            t.turn.split(" ")[0],
            (t.context_tokens, t.ttft_reuse_ms),
            textcoords="offset points",
            xytext=(5, 3),
            fontsize=8,
        )
    ax.set_xlabel("context (prompt tokens); points labelled by turn")
    ax.set_ylabel("time to first token (ms, streaming)")
    shape = report.model_shape
    ax.set_title(
        f"kvbridge demo: agent turns on vLLM CPU P/D ({shape.get('num_layers')} layers, "
        f"hidden {shape.get('hidden_size')}, fp32)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the agent ----------------------------------------------------------------------------------------------
class Agent:
    """Streams turns through the OpenAI SDK; each measured turn is sent twice (with reuse, then cold)."""

    def __init__(self, base_url: str, keys: dict[str, str], progress: Progress) -> None:
        from openai import AsyncOpenAI

        self._clients = {
            tenant: AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
            for tenant, key in keys.items()
        }
        self._progress = progress

    async def stream(
        self, tenant: str, messages: list[dict[str, Any]], *, conversation: str, cache_salt: str = ""
    ) -> tuple[str, float, str, int]:
        """One streamed turn: (answer, TTFT ms to the first content chunk, x-kvbridge-reuse, prompt tokens)."""
        extra: dict[str, Any] = {"ignore_eos": True, "skip_special_tokens": False}
        if conversation:
            extra["conversation_id"] = conversation
        if cache_salt:
            extra["cache_salt"] = cache_salt
        client = self._clients[tenant]
        started = time.perf_counter()
        ttft = 0.0
        text, prompt_tokens = "", 0
        create: Any = client.chat.completions.with_streaming_response.create  # messages: plain dicts, tool roles
        async with create(
            model=MODEL,
            messages=messages,
            stream=True,
            max_tokens=OUTPUT_TOKENS,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body=extra,
        ) as response:
            header = response.headers.get("x-kvbridge-reuse", "")
            async for chunk in await response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if not ttft:
                        ttft = (time.perf_counter() - started) * 1000
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    prompt_tokens = chunk.usage.prompt_tokens
        return text, ttft, header, prompt_tokens

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


async def play(
    agent: Agent, gateway_grpc: str, lease_address: str, keys: dict[str, str], progress: Progress
) -> list[TurnReport]:
    """The conversation: tool calls with pauses, a stripped tool output, another tenant, a fork."""
    from kvbridge.sdk import ClientOptions, GatewayClient

    conv_id = "trip-" + secrets.token_hex(6)
    reports: list[TurnReport] = []

    async def measured(
        label: str,
        tenant: str,
        messages: list[dict[str, Any]],
        conversation: str,
        expect: str,
        paused_s: float = 0.0,
        rounds: int = 0,
    ) -> str:
        answer, ttft, header, prompt_tokens = await agent.stream(tenant, messages, conversation=conversation)
        verdict, pulled = parse_reuse_header(header)
        # The same messages with nothing to reuse: a conversation id and a cache salt never seen before.
        _, cold_ttft, cold_header, _ = await agent.stream(
            tenant, messages, conversation=f"{conv_id}-cold-{len(reports)}", cache_salt=secrets.token_hex(8)
        )
        row = TurnReport(
            label,
            tenant,
            conversation,
            prompt_tokens,
            verdict,
            pulled,
            round(ttft, 1),
            round(cold_ttft, 1),
            parse_reuse_header(cold_header)[0],
            expect,
            paused_s,
            rounds,
        )
        reports.append(row)
        progress(
            f"{label}: {prompt_tokens} tokens, {header or 'no reuse header'}, TTFT {ttft:.0f} ms "
            f"(without reuse {cold_ttft:.0f} ms, {row.ratio:.2f}x)"
        )
        return answer

    async with GatewayClient(
        gateway_grpc,
        ClientOptions(api_key=keys["acme"]),
        lease_target=lease_address,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
    ) as sdk:
        conversation = sdk.conversation(model=MODEL, key=conv_id)
        conversation.open()  # the SDK's heartbeat renews this conversation's lease from now on
        heartbeater = sdk.conversation_leases.heartbeater if sdk.conversation_leases else None

        async def tool_pause(seconds: float) -> int:
            before = heartbeater.rounds if heartbeater else 0
            progress(
                f"the agent runs a tool for {seconds:.0f}s; the SDK heartbeat holds the KV "
                f"(D's entry lease: {ENTRY_LEASE_TTL_S:.0f}s)"
            )
            await asyncio.sleep(seconds)
            return (heartbeater.rounds if heartbeater else 0) - before

        history: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt()},
            {
                "role": "user",
                "content": "Plan a week in Lisbon for two in May, flights from Berlin, "
                "hotel under 180 euros a night. " + _filler("the request", 40),
            },
        ]
        answer = await measured("1 first turn", "acme", history, conv_id, "miss: nothing retained yet")
        for n, (name, words, pause) in enumerate(
            (("search_flights", 180, TOOL_PAUSE_S), ("search_hotels", 220, 3.0)), start=2
        ):
            history += [
                {"role": "assistant", "content": answer},
                {"role": "tool", "content": tool_result(name, words), "tool_call_id": f"call_{n}"},
            ]
            rounds = await tool_pause(pause)
            answer = await measured(
                f"{n} after {name}",
                "acme",
                history,
                conv_id,
                "hit: append-only, the whole previous turn pulled",
                pause,
                rounds,
            )
        history.append({"role": "assistant", "content": answer})
        history.append({"role": "user", "content": "Book the second hotel. " + _filler("booking", 30)})
        # The client drops the hotel search's raw output from its history (as agents strip tool output
        # or reasoning): only the blocks before the edit are verified, the rest is recomputed.
        stripped = [
            dict(m, content='{"tool": "search_hotels", "status": "ok"} (output elided)')
            if m.get("tool_call_id") == "call_3"
            else m
            for m in history
        ]
        await measured(
            "4 hotel output stripped",
            "acme",
            stripped,
            conv_id,
            "hit, partial: verified up to the stripped tool output",
        )
        await measured(
            "5 other tenant, same id", "globex", stripped, conv_id, "miss: another tenant never sees acme's KV"
        )
        fork = [history[0], {"role": "user", "content": "Plan a weekend in Porto for one. " + _filler("porto", 40)}]
        await measured(
            "6 fork, shared system prompt",
            "acme",
            fork,
            "",
            "hit: content-addressed (no conversation id), the system prompt's blocks",
        )
        released = await conversation.close()
        progress(f"conversation closed: decode-held KV released ({released})")
    return reports


# -- the run ------------------------------------------------------------------------------------------------
def write_keys_file(directory: Path) -> tuple[Path, str, dict[str, str]]:
    """A keys file (docs/security.md) with one service key (gateway, engine, operator) and two tenant keys."""

    def key() -> str:
        return "kvb_" + secrets.token_hex(24)

    service = key()
    tenants = {"acme": key(), "globex": key()}
    spec: dict[str, Any] = {service: {"name": "kvbridge-demo-services", "roles": ["gateway", "engine", "operator"]}}
    spec.update({k: {"name": f"{t}-app", "role": "tenant", "tenant": t} for t, k in tenants.items()})
    path = directory / "keys.json"
    path.write_text(json.dumps(spec, indent=2))
    path.chmod(0o600)
    return path, service, tenants


def other_vllm_engines() -> list[str]:
    """Command lines of vLLM servers already running on this machine (they share its cores)."""
    try:
        out = subprocess.run(["pgrep", "-af", "vllm.entrypoints"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.strip()]


async def run(
    *,
    etcd: str = "",
    engines_dir: Path | None = None,
    png: Path | None = None,
    registry_port: int = 0,
    lease_port: int = 0,
    start_timeout_s: float = 900.0,
    progress: Progress,
) -> DemoReport:
    from kvbridge_services.common.config import ServerSettings, StoreSettings
    from kvbridge_services.devengines.local import LocalEnginesConfig
    from kvbridge_services.devengines.model import SHAPES
    from kvbridge_services.gateway.config import GatewaySettings
    from kvbridge_services.stack import Stack, StackConfig

    began = time.monotonic()
    busy = other_vllm_engines()
    if busy:
        progress(
            f"note: {len(busy)} other vLLM processes are running on this machine; they share its cores "
            "and slow everything here"
        )
    secrets_dir = Path(tempfile.mkdtemp(prefix="kvbridge-demo-"))
    keys_file, service_key, tenant_keys = write_keys_file(secrets_dir)
    # Secure mode: every service reads the keys file; the gateway, the registry and (inherited through the
    # environment) the engines' connectors present the one service key.
    os.environ["KVBRIDGE_API_KEYS_FILE"] = str(keys_file)
    os.environ["KVBRIDGE_API_KEY"] = service_key
    progress(f"secure mode: keys file {keys_file} (service key: gateway+engine+operator; tenants acme, globex)")
    store = StoreSettings()
    if etcd:
        endpoints = StoreSettings(etcd_endpoints=cast(Any, etcd)).etcd_endpoints
        store = store.model_copy(update={"etcd_endpoints": endpoints})
    engines = LocalEnginesConfig(
        shape="demo",
        max_model_len=MAX_MODEL_LEN,
        start_timeout_s=start_timeout_s,
        decode_extra={"kvbridge_entry_lease_ttl_s": ENTRY_LEASE_TTL_S},
    )
    if engines_dir is not None:
        engines.work_dir = engines_dir
    config = StackConfig(
        store=store,
        server=ServerSettings(),
        registry_port=registry_port,
        lease_port=lease_port,
        gateway=GatewaySettings(http_port=0, grpc_port=0, content_lookup=True),
        engines=engines,
    )
    report = DemoReport(model_shape=asdict(SHAPES["demo"]), keys_file=str(keys_file))
    stack = Stack(config, progress=progress)
    try:
        await stack.start()
        assert stack.gateway is not None and stack.lease is not None
        report.engine_start_s = round(time.monotonic() - began, 1)
        progress(
            f"stack and engines up after {report.engine_start_s:.0f}s; playing the agent "
            f"(OpenAI SDK, streaming, gateway {stack.gateway.http_url})"
        )
        agent = Agent(stack.gateway.http_url + "/v1", tenant_keys, progress)
        try:
            report.turns = await play(agent, stack.gateway.grpc_address, stack.lease.address, tenant_keys, progress)
        finally:
            await agent.close()
    finally:
        await stack.stop()
        with suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, secrets_dir)
    png = png or engines.work_dir / "demo-ttft.png"
    report.total_s = round(time.monotonic() - began, 1)
    write_png(report, png)
    report.png = str(png)
    return report


def _print_report(report: DemoReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    print(format_table(report))
    print()
    for t in report.turns:
        pause = f" (after a {t.paused_s:.0f}s tool pause, {t.heartbeat_rounds} heartbeat rounds)" if t.paused_s else ""
        print(f"  {t.turn}: {t.expect}{pause}")
    print(
        f"\nTTFT = time to the first streamed content chunk through the gateway; 'cold' = the same messages "
        f"sent again\nwith a new conversation id and cache_salt (nothing to reuse). Engines up after "
        f"{report.engine_start_s:.0f}s, whole run {report.total_s:.0f}s.\nPNG: {report.png}"
    )


async def main_async(args: Any, progress: Progress) -> int:
    """The CLI entry (``kvbridge demo``): Ctrl-C or SIGTERM stops the engines' process groups, then the services."""
    with stop_on_signals() as stop:
        return await _until_stopped(args, progress, stop)


async def _until_stopped(args: Any, progress: Progress, stop: asyncio.Event) -> int:
    demo = asyncio.create_task(
        run(
            etcd=args.etcd,
            engines_dir=Path(args.engines_dir) if args.engines_dir else None,
            png=Path(args.png) if args.png else None,
            registry_port=args.registry_port,
            lease_port=args.lease_port,
            start_timeout_s=args.engine_start_timeout,
            progress=progress,
        )
    )
    if not await ended_before(demo, stop, lambda: progress("interrupted: stopping the engines and the services")):
        progress("stopped")  # run()'s finally stopped the stack (engines first)
        return 130
    try:
        report = demo.result()
    except (OSError, RuntimeError, TimeoutError) as exc:  # a port in use, an engine that died or hung
        print(f"kvbridge: demo failed: {exc}", file=sys.stderr)
        return 1
    _print_report(report, args.json)
    return 0


__all__ = ["DemoReport", "TurnReport", "main_async", "parse_reuse_header", "run", "write_keys_file"]
