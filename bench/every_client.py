"""Every client reuses (issue 27): a keyless client against a keyed one and against no reuse, on real vLLM CPU
engines with the kvbridge connector, through the stock OpenAI Python SDK (streaming, no kvbridge field).

    .venv/bin/python bench/every_client.py --out bench/results/every_client
    .venv/bin/python bench/every_client.py --quick          # a smoke run (1 repetition, 4 conversations)

Starts etcd + registry + lease manager processes and one prefill and one decode vLLM CPU engine with the kvbridge
connector (tests/fixtures: the tiny random-weight model, greedy), then three gateways in this process on the
same engines: **keyless** (reuse on; the client sends its whole history and no conversation key), **keyed**
(reuse on; ``conversation_id`` in ``extra_body``) and **none** (reuse off). Per repetition, ``--conversations``
conversations of ``--turns`` turns each (a system prompt, a user message, then each answer and a new user
message), two conversations at once, every turn sent to the three arms one after another in a rotating order.
The keyless and none arms send identical messages (the none arm's answer is the reference: a keyless answer that
differs is a wrong answer); the keyed arm has its own messages of the same sizes (identical content would let the
keyless arm find the keyed arm's blocks by content).

Reports per arm: later turns (after each conversation's first) and their hits, wrong answers, TTFT (the client's
time to the first streamed chunk) of later turns as a median with a bootstrap 95 % interval over all repetitions,
the ratios keyless / keyed and none / keyless with intervals, and each gateway's own time per turn from its
``kvbridge_gateway_router_overhead_seconds`` histogram (p50 interpolated in its buckets). Writes <out>.md,
<out>.json and <out>.png (TTFT by turn, each arm's median with its interval).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import kvbridge_overrides  # noqa: E402
from tests.e2e.gateway_turns import registry_routed_gateway  # noqa: E402
from tests.fixtures.control_plane_procs import run_control_plane  # noqa: E402
from tests.fixtures.tiny_model import build  # noqa: E402
from tests.fixtures.vllm_engines import EnginePool  # noqa: E402

from kvbridge_services.gateway.app import GatewayApp  # noqa: E402

MODEL = "tiny"
ARMS = ("keyless", "keyed", "none")
WORDS = [f"w{i}" for i in range(300)]


def progress(message: str) -> None:
    print(f"[every-client {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class TurnRecord:
    arm: str
    rep: int
    conversation: int
    turn: int
    verdict: str
    ttft_s: float
    wrong: bool = False


@dataclass
class Results:
    turns: list[TurnRecord] = field(default_factory=list)
    overhead_p50_ms: dict[str, float] = field(default_factory=dict)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _stream(
    client: openai.AsyncOpenAI, messages: list[Any], max_tokens: int, **extra: Any
) -> tuple[str, str, float]:
    started = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, stream=True, temperature=0, max_tokens=max_tokens, seed=7, **extra
    )
    verdict = raw.headers.get("x-kvbridge-reuse", "")
    first: float | None = None
    parts: list[str] = []
    async for chunk in raw.parse():
        if first is None:
            first = time.perf_counter() - started
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    return "".join(parts), verdict, first if first is not None else time.perf_counter() - started


def _overhead_p50_ms(gw: GatewayApp) -> float:
    """p50 of the gateway's own time per turn, interpolated in its histogram's buckets."""
    text = gw.core.metrics.render().decode()
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("kvbridge_gateway_router_overhead_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan")
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= total / 2:
            if le == float("inf"):
                return prev_le * 1000
            frac = (total / 2 - prev_count) / max(count - prev_count, 1e-9)
            return (prev_le + frac * (le - prev_le)) * 1000
        prev_le, prev_count = le, count
    return float("nan")


@dataclass
class _Repetition:
    """One repetition's conversations: ``shared`` for the keyless and none arms, ``keyed`` (same sizes, other
    words) for the keyed arm, and the keyed arm's conversation ids."""

    rep: int
    shared: list[list[Any]]
    keyed: list[list[Any]]
    keys: list[str]

    @classmethod
    def new(cls, args: argparse.Namespace, rep: int) -> _Repetition:
        def fresh(r: random.Random) -> list[Any]:
            return [
                {"role": "system", "content": _text(r, args.system_words)},
                {"role": "user", "content": _text(r, args.user_words)},
            ]

        rng, keyed_rng = random.Random(1000 + rep), random.Random(2000 + rep)
        return cls(
            rep,
            [fresh(rng) for _ in range(args.conversations)],
            [fresh(keyed_rng) for _ in range(args.conversations)],
            [f"bench-{rep}-{c}-{time.monotonic_ns()}" for c in range(args.conversations)],
        )


async def _turn(
    args: argparse.Namespace,
    clients: dict[str, openai.AsyncOpenAI],
    state: _Repetition,
    results: Results,
    c: int,
    t: int,
) -> None:
    """Turn ``t`` of conversation ``c`` on the three arms, in an order that rotates with the turn."""
    answers: dict[str, str] = {}
    for arm in ARMS[t % 3 :] + ARMS[: t % 3]:
        msgs = state.keyed[c] if arm == "keyed" else state.shared[c]
        extra: dict[str, Any] = {"extra_body": {"conversation_id": state.keys[c]}} if arm == "keyed" else {}
        answer, verdict, ttft = await _stream(clients[arm], msgs, args.max_tokens, **extra)
        answers[arm] = answer
        results.turns.append(TurnRecord(arm, state.rep, c, t, verdict, ttft))
    keyless = next(r for r in reversed(results.turns) if r.arm == "keyless" and r.conversation == c)
    keyless.wrong = answers["keyless"] != answers["none"]
    user = _text(random.Random(f"{state.rep}-{c}-{t}"), args.turn_words)
    state.shared[c] += [{"role": "assistant", "content": answers["keyless"]}, {"role": "user", "content": user}]
    state.keyed[c] += [{"role": "assistant", "content": answers["keyed"]}, {"role": "user", "content": user}]


async def _run(args: argparse.Namespace, gateways: dict[str, GatewayApp], results: Results) -> None:
    clients = {
        arm: openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="unused", timeout=600, max_retries=0)
        for arm, gw in gateways.items()
    }
    for rep in range(args.reps):
        state = _Repetition.new(args, rep)
        for t in range(args.turns):
            for pair in range(0, args.conversations, 2):
                pairs = range(pair, min(pair + 2, args.conversations))
                await asyncio.gather(*(_turn(args, clients, state, results, c, t) for c in pairs))
            progress(
                f"repetition {rep + 1}/{args.reps}: turn {t + 1}/{args.turns} of {args.conversations} conversations"
            )
    for arm, gw in gateways.items():
        results.overhead_p50_ms[arm] = _overhead_p50_ms(gw)


# -- the other client kinds: each against reuse (the keyless gateway) and none, identical requests ----------------
KINDS = ("responses", "responses-chained", "messages", "chat-tools")
TOOLS_CHAT: list[Any] = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
TOOLS_ANTHROPIC: list[Any] = [
    {"name": "lookup", "description": "looks a word up", "input_schema": {"type": "object"}},
]


@dataclass
class _Clients:
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic


@dataclass
class _KindConversation:
    """One conversation of a client kind: its history as that API sends it (the same for both arms), and for a
    chained Responses conversation each arm's previous response id."""

    kind: str
    history: list[Any]
    pending: str = ""  # a chained conversation's next input
    previous: dict[str, str | None] = field(default_factory=lambda: {"reuse": None, "none": None})


async def _first_event(started: float, stream: Any, is_text: Any, text_of: Any) -> tuple[str, float, Any]:
    """Reads a stream of SDK events: the text of those ``is_text`` says carry it, the time to the first of them,
    and the last event."""
    first: float | None = None
    parts: list[str] = []
    last = None
    async for event in stream:
        last = event
        if is_text(event):
            if first is None:
                first = time.perf_counter() - started
            parts.append(text_of(event))
    return "".join(parts), first if first is not None else time.perf_counter() - started, last


async def _kind_turn(
    args: argparse.Namespace, clients: _Clients, conv: _KindConversation, arm: str
) -> tuple[str, str, float]:
    started = time.perf_counter()
    if conv.kind == "chat-tools":
        return await _stream(clients.openai, conv.history, args.max_tokens, tools=TOOLS_CHAT)
    if conv.kind in ("responses", "responses-chained"):
        chained = conv.kind == "responses-chained"
        raw = await clients.openai.responses.with_raw_response.create(
            model=MODEL,
            input=conv.pending if chained and conv.previous[arm] else conv.history,
            previous_response_id=conv.previous[arm] if chained else None,
            stream=True,
            temperature=0,
            max_output_tokens=args.max_tokens,
        )
        text, ttft, last = await _first_event(
            started, raw.parse(), lambda e: e.type == "response.output_text.delta", lambda e: e.delta
        )
        if chained and last is not None and last.type in ("response.completed", "response.incomplete"):
            conv.previous[arm] = last.response.id
        return text, raw.headers.get("x-kvbridge-reuse", ""), ttft
    raw_m = await clients.anthropic.messages.with_raw_response.create(
        model=MODEL,
        system="be brief",
        messages=conv.history,
        tools=TOOLS_ANTHROPIC,
        max_tokens=args.max_tokens,
        stream=True,
        extra_body={"temperature": 0},
    )
    text, ttft, _ = await _first_event(
        started,
        await raw_m.parse(),
        lambda e: e.type == "content_block_delta" and e.delta.type == "text_delta",
        lambda e: e.delta.text,
    )
    return text, raw_m.headers.get("x-kvbridge-reuse", ""), ttft


def _extend(conv: _KindConversation, answer: str, user: str, t: int) -> None:
    """The next request, as that kind of client writes it: the answer, a tool call and its result, or (chained)
    only the new input."""
    if conv.kind == "chat-tools":
        call = {"id": f"call_{t}", "type": "function", "function": {"name": "search", "arguments": '{"q": 1}'}}
        conv.history += [
            {"role": "assistant", "content": answer, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{t}", "content": user},
        ]
    elif conv.kind == "messages":
        conv.history += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": answer or "ok"},
                    {"type": "tool_use", "id": f"toolu_{t}", "name": "lookup", "input": {"word": f"w{t}"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": user}]},
        ]
    else:
        conv.history += [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]
        conv.pending = user


async def _run_kinds(args: argparse.Namespace, gateways: dict[str, GatewayApp], results: Results) -> None:
    clients = {
        arm: _Clients(
            openai.AsyncOpenAI(base_url=gateways[gw].http_url + "/v1", api_key="unused", timeout=600, max_retries=0),
            anthropic.AsyncAnthropic(base_url=gateways[gw].http_url, api_key="unused", timeout=600, max_retries=0),
        )
        for arm, gw in (("reuse", "keyless"), ("none", "none"))
    }
    for rep in range(args.reps):
        for kind in KINDS:
            rng = random.Random(f"{kind}-{rep}")
            convs = [
                _KindConversation(kind, [{"role": "user", "content": _text(rng, args.system_words + args.user_words)}])
                for _ in range(args.kind_conversations)
            ]

            async def one(
                c: int, t: int, convs: list[_KindConversation] = convs, kind: str = kind, rep: int = rep
            ) -> None:
                answers: dict[str, str] = {}
                for arm in ("reuse", "none") if t % 2 == 0 else ("none", "reuse"):
                    answer, verdict, ttft = await _kind_turn(args, clients[arm], convs[c], arm)
                    answers[arm] = answer
                    results.turns.append(TurnRecord(f"{kind}:{arm}", rep, c, t, verdict, ttft))
                mine = next(r for r in reversed(results.turns) if r.arm == f"{kind}:reuse" and r.conversation == c)
                mine.wrong = answers["reuse"] != answers["none"]
                _extend(convs[c], answers["reuse"], _text(random.Random(f"{kind}-{rep}-{c}-{t}"), args.turn_words), t)

            for t in range(args.turns):
                for pair in range(0, len(convs), 2):
                    await asyncio.gather(*(one(c, t) for c in range(pair, min(pair + 2, len(convs)))))
            progress(f"repetition {rep + 1}/{args.reps}: {kind}, {len(convs)} conversations x {args.turns} turns")


def _median_ci(values: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float, float]:
    if not values:
        return float("nan"), float("nan"), float("nan")
    boots = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return statistics.median(values), boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def _ratio_ci(a: list[float], b: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float, float]:
    """median(a) / median(b) with a bootstrap 95 % interval."""
    if not a or not b:
        return float("nan"), float("nan"), float("nan")
    boots = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b))) for _ in range(n)
    )
    return statistics.median(a) / statistics.median(b), boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def _report(args: argparse.Namespace, results: Results, command: str, wall_s: float) -> str:
    rng = random.Random(0)
    later = {arm: [r for r in results.turns if r.arm == arm and r.turn > 0] for arm in ARMS}
    ttft = {arm: [r.ttft_s for r in later[arm]] for arm in ARMS}
    lines = [
        "# Every client: keyless vs keyed vs no reuse (issue 27)",
        "",
        f"Command: `{command}` ({wall_s:.0f} s including engine start). Real vLLM CPU engines (1P1D, kvbridge "
        "connector, tiny random-weight model, greedy), the stock OpenAI Python SDK streaming, "
        f"{args.reps} repetitions x {args.conversations} conversations x {args.turns} turns, two conversations "
        "at once.",
        "",
        "| arm | later turns | hits | hit rate | wrong answers | TTFT p50 of later turns (95 % CI) "
        "| gateway's own time p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        rows = later[arm]
        hits = sum(r.verdict.startswith("hit;") for r in rows)
        wrong = sum(r.wrong for r in results.turns if r.arm == arm)
        med, lo, hi = _median_ci(ttft[arm], rng)
        wrong_cell = str(wrong) if arm == "keyless" else "n/a"
        lines.append(
            f"| {arm} | {len(rows)} | {hits} | {hits / max(len(rows), 1):.0%} | {wrong_cell} | "
            f"{med * 1000:.1f} ms ({lo * 1000:.1f}-{hi * 1000:.1f}) | "
            f"{results.overhead_p50_ms.get(arm, float('nan')):.2f} ms |"
        )
    r1 = _ratio_ci(ttft["keyless"], ttft["keyed"], rng)
    r2 = _ratio_ci(ttft["none"], ttft["keyless"], rng)
    lines += [
        "",
        f"- TTFT keyless / keyed (later turns, medians): **{r1[0]:.3f}x** (95 % CI {r1[1]:.3f}-{r1[2]:.3f}); "
        "goal <= 1.05x.",
        f"- TTFT none / keyless: **{r2[0]:.2f}x** (95 % CI {r2[1]:.2f}-{r2[2]:.2f}).",
        f"- Gateway's own time per turn, p50: keyless {results.overhead_p50_ms.get('keyless', float('nan')):.2f} ms, "
        f"keyed {results.overhead_p50_ms.get('keyed', float('nan')):.2f} ms (goal: keyless <= keyed + 1 ms); from each "
        "gateway's `kvbridge_gateway_router_overhead_seconds` histogram, interpolated in its buckets.",
        "- Wrong answers: a keyless answer that differs from the none arm's answer to identical messages.",
        "",
        *_kinds_report(args, results, rng),
        f"![TTFT by turn]({Path(args.out).name}.png)",
        "",
        "Every turn's arm, repetition, conversation, turn, verdict and TTFT are in the JSON beside this page.",
    ]
    return "\n".join(lines) + "\n"


def _kinds_report(args: argparse.Namespace, results: Results, rng: random.Random) -> list[str]:
    if not any(":" in r.arm for r in results.turns):
        return []
    lines = [
        f"## Per client kind ({args.reps} repetitions x {args.kind_conversations} conversations x {args.turns} turns, "
        "two at once; each turn sent with reuse (the keyless gateway) and without (reuse off), identical requests)",
        "",
        "`responses`: the Responses API streaming, the whole history as `input`; `responses-chained`: only the new "
        "input, chained by `previous_response_id`; `messages`: the Anthropic SDK streaming, a `tool_use` / "
        "`tool_result` history; `chat-tools`: chat completions streaming with `tools`, assistant `tool_calls` and "
        "`tool` messages. No request carries a conversation key.",
        "",
        "| kind | later turns | hits | wrong answers | TTFT p50 with reuse (95 % CI) | TTFT p50 without (95 % CI) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        mine = [r for r in results.turns if r.arm == f"{kind}:reuse" and r.turn > 0]
        none = [r for r in results.turns if r.arm == f"{kind}:none" and r.turn > 0]
        hits = sum(r.verdict.startswith("hit;") for r in mine)
        wrong = sum(r.wrong for r in results.turns if r.arm == f"{kind}:reuse")
        w, wlo, whi = _median_ci([r.ttft_s for r in mine], rng)
        n, nlo, nhi = _median_ci([r.ttft_s for r in none], rng)
        lines.append(
            f"| {kind} | {len(mine)} | {hits} | {wrong} | {w * 1000:.1f} ms ({wlo * 1000:.1f}-{whi * 1000:.1f}) | "
            f"{n * 1000:.1f} ms ({nlo * 1000:.1f}-{nhi * 1000:.1f}) |"
        )
    return [*lines, ""]


def _plot(args: argparse.Namespace, results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = random.Random(1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(ARMS):
        xs: list[float] = []
        meds, los, his = [], [], []
        for t in range(args.turns):
            values = [r.ttft_s * 1000 for r in results.turns if r.arm == arm and r.turn == t]
            med, lo, hi = _median_ci(values, rng)
            xs.append(t + 1 + (i - 1) * 0.08)
            meds.append(med)
            los.append(med - lo)
            his.append(hi - med)
        ax.errorbar(xs, meds, yerr=[los, his], marker="o", capsize=3, label=arm)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, ms (median, 95 % CI)")
    ax.set_title("Keyless vs keyed vs no reuse, stock OpenAI SDK, real vLLM CPU engines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=110)


async def _gateways(procs: Any, stack: contextlib.AsyncExitStack) -> dict[str, GatewayApp]:
    return {
        "keyless": await stack.enter_async_context(registry_routed_gateway(procs, reuse=True)),
        "keyed": await stack.enter_async_context(registry_routed_gateway(procs, reuse=True)),
        "none": await stack.enter_async_context(registry_routed_gateway(procs, reuse=False)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench/results/every_client"), help="writes <out>.md/.json/.png")
    p.add_argument("--reps", type=int, default=3, help="repetitions")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=200)
    p.add_argument("--turn-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--kind-conversations",
        type=int,
        default=4,
        help="conversations per other client kind (Responses, chained Responses, Anthropic Messages, chat with "
        "tools); 0: the chat arms only",
    )
    p.add_argument("--quick", action="store_true", help="1 repetition of 4 conversations x 3 turns")
    p.add_argument("--work-dir", type=Path, help="keep the engines' and services' logs here (default: a temp dir)")
    args = p.parse_args()
    if args.quick:
        args.reps, args.conversations, args.turns, args.kind_conversations = 1, 4, 3, 2
    command = "python bench/every_client.py " + " ".join(sys.argv[1:])
    started = time.monotonic()
    results = Results()
    with contextlib.ExitStack() as keep:
        work = args.work_dir or Path(keep.enter_context(tempfile.TemporaryDirectory(prefix="kvb-every-client-")))
        progress("starting etcd, registry and lease manager")
        with run_control_plane(work / "control-plane") as procs:
            progress("building the tiny model and starting the prefill and decode vLLM engines (1-3 min)")
            pool = EnginePool(build(work / "model"), work / "vllm-logs")
            try:
                prefill, decode = kvbridge_overrides(procs)
                pool.get("kvbridge", prefill, decode)
                progress("engines up; starting three gateways")

                async def go() -> None:
                    async with contextlib.AsyncExitStack() as stack:
                        gateways = await _gateways(procs, stack)
                        await _run(args, gateways, results)
                        if args.kind_conversations:
                            await _run_kinds(args, gateways, results)

                asyncio.run(go())
            finally:
                pool.close()
    wall = time.monotonic() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in results.turns], indent=1) + "\n")
    out.with_suffix(".md").write_text(_report(args, results, command, wall))
    _plot(args, results)
    progress(f"wrote {out}.md, {out}.json, {out}.png")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
