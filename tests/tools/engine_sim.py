"""Engine simulator: a stand-in for a vLLM OpenAI server in a P/D pair (test tool).

See tests/tools/README.md. Run: ``python -m tests.tools.engine_sim --role prefill --port 8100``.
In-process: ``async with SimServer(SimConfig(...)) as sim: sim.url``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from tests.tools.sim_connector import SimConnector

BOS, EOS = 0, 1
ROLE_TOKENS = {"system": 2, "user": 3, "assistant": 4, "tool": 5}
END_OF_MESSAGE = 6
FIRST_WORD_TOKEN = 10
_FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1


@dataclass
class SimConfig:
    role: str = "decode"  # "prefill" | "decode" | "both"
    model: str = "sim-model"
    engine_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    vocab: int = 512
    block_size: int = 16
    total_blocks: int = 4096
    max_model_len: int = 8192
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    kv_recompute_threshold: int = 0
    kv_load_failure_policy: str = "fail"  # "fail" | "recompute"
    bidirectional: bool = True
    prefill_us_per_token: float = 0.0
    decode_us_per_token: float = 0.0
    # A slow or hung engine: each generation pauses stall_s seconds after stall_after_tokens tokens
    # (0: before the first token, i.e. a stuck prefill). /health still answers, as a wedged vLLM's does.
    stall_s: float = 0.0
    stall_after_tokens: int = 0
    # A directory with HF tokenizer files (e.g. the dev tokenizer of kvbridge_services.devengines.model):
    # /tokenize, prompt rendering and output text then use that tokenizer and its chat template, as vLLM
    # does, instead of the built-in whitespace tokenizer. Output token ids must be in its vocabulary.
    hf_tokenizer: str = ""
    # LoRA adapter names /v1/models lists (with the model as their parent, as vLLM does); served like the model.
    lora_adapters: tuple[str, ...] = ()
    # vLLM's automatic prefix caching (on by default in vLLM; off here so older tests keep their exact pulls): a
    # prompt's longest prefix of whole blocks (at most all but its last token) already in this engine's blocks,
    # held or freed but not yet reused, is neither computed nor pulled. A D that holds a conversation's previous
    # turn pulls only the new suffix from P (vLLM's NIXL worker reads only the tail of P's block ids), and a plain
    # request prefills only the uncached part. Blocks are hashed by the token ids they were computed for, as vLLM's.
    prefix_caching: bool = False
    # What a pull moves and how long it takes: bytes per token of KV, and the link's bytes/s (0: instant).
    kv_bytes_per_token: int = 0
    pull_bytes_per_s: float = 0.0
    # One compute unit per engine: prefills run one at a time, and a decode step waits for the prefill running
    # (D's local prefill stalls its decodes, P's queued prefills wait). False: requests never slow each other.
    serialize_compute: bool = False
    # Non-streaming responses carry "sim_timing": when the first token was generated (wall clock) and the
    # prompt tokens hit in the local prefix cache, pulled and computed.
    report_timing: bool = False
    # Admission as vLLM's scheduler does it: a request takes its KV blocks (prompt + max_tokens, less a prefix-cache
    # hit, which it shares) before it runs and waits, first come first served, while the cache lacks them (free
    # blocks less those running requests took); the connector is told what the request at the head waits for.
    # False: a request never waits (it takes blocks only when it finishes).
    admission: bool = False
    # P starts its READ of an offer this long after accepting it (a busy queue); a READ that would start past the
    # offer's deadline (less kvbridge.offers.READ_START_MARGIN_S) is declined and P computes, as vLLM's worker does.
    read_delay_s: float = 0.0
    # /metrics states the engine's KV cache config as vLLM 0.32 does (v1/metrics/loggers.py log_metrics_info: the
    # gauge vllm:cache_config_info, one label per CacheConfig field, block_size among them). False: it does not.
    cache_config_info: bool = True
    # The engine runs vLLM's NixlConnector (--kv-transfer-config): a request with kv_transfer_params gets its
    # engine's params back (engine id, NIXL side-channel host and port). False: a stock vLLM started without a KV
    # connector, whose responses carry "kv_transfer_params": null.
    kv_connector: bool = True
    # The kvbridge connector's kv_connector_extra_config (tests/tools/sim_connector.py): with
    # ``kvbridge_registry`` set the engine runs the connector's control plane (connector mode): it registers
    # itself and D's retained requests, P pulls only signed offers whose prefix digest matches its prompt.
    kvbridge_config: dict[str, Any] = field(default_factory=dict)


# ---- tokenizer and "model" -------------------------------------------------------------


def tokenize_text(text: str, vocab: int) -> list[int]:
    ids: list[int] = []
    for word in text.split():
        if word.startswith("w") and word[1:].isdigit() and FIRST_WORD_TOKEN <= int(word[1:]) < vocab:
            ids.append(int(word[1:]))
        else:
            ids.append(FIRST_WORD_TOKEN + zlib.crc32(word.encode()) % (vocab - FIRST_WORD_TOKEN))
    return ids


def render_chat(messages: list[dict[str, Any]], vocab: int, add_generation_prompt: bool = True) -> list[int]:
    ids = [BOS]
    for msg in messages:
        ids.append(ROLE_TOKENS.get(str(msg.get("role")), ROLE_TOKENS["user"]))
        content = msg.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        ids.extend(tokenize_text(str(content), vocab))
        ids.append(END_OF_MESSAGE)
    if add_generation_prompt:
        ids.append(ROLE_TOKENS["assistant"])
    return ids


def detokenize(token_id: int) -> str:
    return f" w{token_id}"


class HfText:
    """The real tokenizer + chat template path of vLLM's /tokenize and chat prompts (``--hf-tokenizer``)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def chat(self, body: dict[str, Any]) -> list[int]:
        try:
            text = self.tok.apply_chat_template(
                body["messages"],
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **(body.get("chat_template_kwargs") or {}),
            )
        except Exception as exc:  # a template error is the client's (HTTP 400), as in vLLM
            raise ApiError(400, f"chat template: {exc}") from exc
        return self.text(str(text), bool(body.get("add_special_tokens", False)))

    def text(self, text: str, add_special_tokens: bool) -> list[int]:
        # The backend's encode(): the ids of HF's __call__ (what vLLM uses) without its thread-pool hand-off.
        return list(self.tok.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def detokenize(self, token_id: int) -> str:
        return " " + str(self.tok.convert_ids_to_tokens(token_id))


def _mix(state: int, token: int) -> int:
    return ((state ^ (token + 1)) * _FNV_PRIME) & _MASK


def greedy_tokens(kv_tokens: list[int], n: int, vocab: int) -> Iterator[int]:
    """Greedy output as a function of the KV content (prompt as the engine 'sees' it)."""
    state = 14695981039346656037
    for tok in kv_tokens:
        state = _mix(state, tok)
    for _ in range(n):
        nxt = FIRST_WORD_TOKEN + (state >> 17) % (vocab - FIRST_WORD_TOKEN)
        yield nxt
        state = _mix(state, nxt)


# ---- KV block store ----------------------------------------------------------------------


class KVError(Exception):
    pass


_ROOT_HASH = 0x6B7662726964676


def chain_hash(parent: int, tokens: list[int]) -> int:
    """A block's prefix-cache hash: its parent's and its own token ids (vLLM's hash_block_tokens, simplified)."""
    return hash((parent, tuple(tokens)))


def root_hash(cache_salt: str) -> int:
    """The chain's start: requests with another cache_salt share no prefix-cache blocks (as in vLLM)."""
    return hash((_ROOT_HASH, cache_salt))


@dataclass
class Held:
    block_ids: list[int]
    deadline: float  # perf_counter-free wall clock (time.time) deadline
    # Held by reference for the kvbridge connector (connector mode): a READ leaves the blocks held.
    multi_use: bool = False


@dataclass
class BlockStore:
    """A fixed pool of KV blocks, like vLLM's: ids 0..total-1, freed ids are reused (oldest freed first), and a
    freed block keeps its stale content until it is reused. A NIXL READ is one-sided: it returns whatever the
    named blocks hold *now* (freed, or reused by another request, possibly another tenant's); D can neither
    see nor refuse it. Only its notification afterwards tells D that someone read."""

    block_size: int
    total: int
    blocks: dict[int, list[int]] = field(default_factory=dict)
    held: dict[str, Held] = field(default_factory=dict)
    # Free block ids in reuse order (vLLM's free queue hands out the least recently freed first).
    free_ids: deque[int] = field(default_factory=deque)
    in_use: set[int] = field(default_factory=set)
    # Reads that named blocks not (or no longer) held by the request they were offered for.
    unsafe_reads: int = 0
    # Prefix cache: chain hash -> block id and back, for full blocks stored with their token ids; a block's hash
    # goes when its id is reused (freed blocks stay findable until then, as in vLLM's block pool).
    by_hash: dict[int, int] = field(default_factory=dict)
    hash_of: dict[int, int] = field(default_factory=dict)
    # References of blocks in use beyond the first (a prefix-cache hit shares blocks between requests).
    extra_refs: dict[int, int] = field(default_factory=dict)
    # Blocks running requests took at admission (SimConfig.admission) and have not stored yet.
    reserved: int = 0

    def __post_init__(self) -> None:
        self.free_ids.extend(range(self.total))

    def available(self) -> int:
        """Free blocks no running request has taken."""
        return len(self.free_ids) - self.reserved

    def usage(self) -> float:
        self.reap()
        return len(self.in_use) / self.total

    def store(self, tokens: list[int], hash_tokens: list[int] | None = None, parent: int = 0) -> list[int]:
        """New blocks holding ``tokens`` (KV content). With ``hash_tokens`` (the token ids that content was
        computed for) the full blocks enter the prefix cache, chained after ``parent``."""
        self.reap()
        b = self.block_size
        needed = -(-len(tokens) // b)
        if needed > len(self.free_ids):
            raise KVError("out of KV blocks")
        ids = []
        for i in range(needed):
            bid = self.free_ids.popleft()
            old = self.hash_of.pop(bid, None)
            if old is not None and self.by_hash.get(old) == bid:
                del self.by_hash[old]
            self.in_use.add(bid)
            self.blocks[bid] = tokens[i * b : (i + 1) * b]
            if hash_tokens is not None and len(self.blocks[bid]) == b:
                parent = chain_hash(parent, hash_tokens[i * b : (i + 1) * b])
                self.by_hash[parent], self.hash_of[bid] = bid, parent
            else:
                hash_tokens = None  # the chain ends at the first partial block
            ids.append(bid)
        return ids

    def prefix_hit(self, token_ids: list[int], limit: int, cache_salt: str) -> tuple[list[int], int]:
        """The blocks of the longest cached prefix of ``token_ids`` (whole blocks, at most ``limit`` tokens), and
        its chain hash (to store the rest after it)."""
        b, parent = self.block_size, root_hash(cache_salt)
        ids: list[int] = []
        for i in range(max(0, limit) // b):
            h = chain_hash(parent, token_ids[i * b : (i + 1) * b])
            bid = self.by_hash.get(h)
            if bid is None:
                break
            ids.append(bid)
            parent = h
        return ids, parent

    def share(self, block_ids: list[int]) -> None:
        """Takes a reference on cached blocks (a prefix hit): in use ones gain one, freed ones leave the free queue."""
        for bid in block_ids:
            if bid in self.in_use:
                self.extra_refs[bid] = self.extra_refs.get(bid, 0) + 1
            else:
                self.free_ids.remove(bid)
                self.in_use.add(bid)

    def hold(self, request_id: str, block_ids: list[int], ttl: float) -> float:
        deadline = time.time() + ttl
        self.held[request_id] = Held(block_ids, deadline)
        return deadline

    def release(self, request_id: str) -> None:
        """Frees a held request's blocks (its entry lease ended); nothing if it is no longer held."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.free(held.block_ids)

    def free(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            if bid in self.in_use:
                extra = self.extra_refs.pop(bid, 0)
                if extra:
                    if extra > 1:
                        self.extra_refs[bid] = extra - 1
                    continue
                self.in_use.discard(bid)
                self.free_ids.append(bid)  # content (and prefix-cache hash) stays until the block is reused

    def reap(self) -> None:
        now = time.time()
        for rid in [r for r, h in self.held.items() if h.deadline <= now]:
            self.free(self.held.pop(rid).block_ids)

    def read(self, request_id: str, block_ids: list[int]) -> list[int]:
        """A one-sided NIXL READ of ``block_ids`` (what they hold now), then the reader's notification for
        ``request_id``, which frees that request's blocks if D still holds them (stock single use; blocks the
        kvbridge connector holds by reference stay held)."""
        self.reap()
        if any(not 0 <= b < self.total for b in block_ids):
            raise KVError("block id outside the KV cache")  # NIXL fails a read outside registered memory
        held = self.held.get(request_id)
        if held is None or any(b not in held.block_ids for b in block_ids):
            self.unsafe_reads += 1
        out: list[int] = []
        for bid in block_ids:
            out.extend(self.blocks.get(bid, [0] * self.block_size))
        if held is not None and not held.multi_use:
            self.free(self.held.pop(request_id).block_ids)
        return out


# ---- the engine ------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Stats:
    requests: int = 0
    remote_pulled_tokens: int = 0
    remote_pulled_bytes: int = 0  # remote_pulled_tokens x kv_bytes_per_token
    remote_reads: int = 0  # NIXL READs issued (a full local hit still notifies: a read of no blocks)
    local_hit_tokens: int = 0  # prompt tokens served by this engine's own prefix cache
    computed_tokens: int = 0  # prompt tokens prefilled here (neither cached nor pulled)
    running: int = 0
    stalled: int = 0  # generations that hit the stall_s pause
    cancelled: int = 0  # non-streaming generations abandoned because the client went away
    # SimConfig.admission: requests that waited for KV blocks, the longest and the total wait (seconds).
    admission_waits: int = 0
    admission_wait_max_s: float = 0.0
    admission_wait_total_s: float = 0.0
    last_kv_transfer_params: dict[str, Any] | None = None
    kv_transfer_params_seen: list[dict[str, Any] | None] = field(default_factory=list)
    bodies_seen: list[dict[str, Any]] = field(default_factory=list)


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.engine_id = cfg.engine_id or f"sim-{uuid.uuid4().hex[:8]}"
        self.kv = BlockStore(cfg.block_size, cfg.total_blocks)
        self.stats = Stats()
        self.fail_next = 0
        self.fail_tokenize = 0  # the next N /tokenize calls answer 503
        self.fail_reads = 0  # the next N NIXL READs of this engine's blocks fail (a transport error)
        self.healthy = True  # False: /health answers 503 (the engine still serves requests)
        self.unstall = asyncio.Event()  # set: stalled generations go on (and new ones do not stall)
        self.compute = asyncio.Lock()  # serialize_compute: the engine's one compute unit
        self.http = httpx.AsyncClient(timeout=10.0)
        self.hf = HfText(cfg.hf_tokenizer) if cfg.hf_tokenizer else None
        self.connector = self._connector(cfg) if cfg.kvbridge_config.get("kvbridge_registry") else None
        # SimConfig.admission: requests waiting for KV blocks, in arrival order -> the blocks each needs.
        self.waiting: dict[str, int] = {}

    def _connector(self, cfg: SimConfig) -> SimConnector:
        from tests.tools.sim_connector import SimConnector  # only connector mode needs the connector package

        connector = SimConnector(
            cfg.kvbridge_config,
            engine_id=self.engine_id,
            role=cfg.role,
            model=cfg.model,
            host=cfg.host,
            port=cfg.port,
            block_size=cfg.block_size,
            total_blocks=cfg.total_blocks,
        )
        connector.start()
        return connector

    def sync_connector(self) -> None:
        """The connector's scheduler step: lease events into its retention table, then its holds and releases."""
        if self.connector is not None:
            self.kv.reap()
            head = next(iter(self.waiting.values()), 0)  # vLLM asks about the head of its queue only
            self.connector.step(self.kv.held, self.kv.release, self.kv.available(), self.kv.total, waiting_blocks=head)

    async def admit(self, request_id: str, prompt: list[int], max_tokens: int, cache_salt: str) -> None:
        """Waits until the request may take its blocks (SimConfig.admission), first come first served: the
        prompt's and ``max_tokens``' blocks less a prefix-cache hit on blocks in use (shared at no cost; a hit on
        a freed block takes that block off the free list, as a new one would). Returns with no await after the
        check, so the caller's ``local_hit`` finds the same hit."""
        total = -(-(len(prompt) + max_tokens) // self.cfg.block_size)
        if total > self.kv.total:
            raise ApiError(400, "the request needs more KV blocks than the engine has")
        start = time.time()
        self.waiting[request_id] = total
        try:
            while True:
                self.sync_connector()
                hit: list[int] = []
                if self.cfg.prefix_caching:
                    hit, _ = self.kv.prefix_hit(prompt, len(prompt) - 1, cache_salt)
                need = total - sum(1 for b in hit if b in self.kv.in_use)
                self.waiting[request_id] = need
                if next(iter(self.waiting)) == request_id and self.kv.available() >= need:
                    break
                await asyncio.sleep(0.005)
        finally:
            del self.waiting[request_id]
        waited = time.time() - start
        if waited > 0.05:
            self.stats.admission_waits += 1
        self.stats.admission_wait_total_s += waited
        self.stats.admission_wait_max_s = max(self.stats.admission_wait_max_s, waited)

    def unreserve(self, head: dict[str, Any]) -> None:
        self.kv.reserved -= head.pop("reserved", 0)

    def detok(self, token_id: int) -> str:
        return self.hf.detokenize(token_id) if self.hf is not None else detokenize(token_id)

    async def pull(self, params: dict[str, Any], n_tokens: int, start: int = 0) -> list[int]:
        """Read tokens ``start..n_tokens`` of the KV of the remote engine named in ``params`` (``start``: a whole
        number of blocks this engine holds already; vLLM's worker then reads only the tail of the remote block
        ids). ``start >= n_tokens`` reads nothing but still notifies the remote engine, as vLLM does."""
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None and float(expiry) <= time.time():
            raise KVError("declining expired remote read")
        groups = params.get("remote_block_ids") or []
        ids = list(groups[0]) if groups and isinstance(groups[0], list) else list(groups)
        need = -(-n_tokens // self.cfg.block_size)
        if len(ids) < need:
            raise KVError("fewer remote blocks than tokens")
        first = min(start, n_tokens) // self.cfg.block_size
        url = f"http://{params['remote_host']}:{params['remote_port']}/sim/nixl/read"
        try:
            resp = await self.http.post(
                url,
                json={
                    "request_id": params["remote_request_id"],
                    "block_ids": ids[first:need],
                    "engine_id": params.get("remote_engine_id"),
                },
            )
        except httpx.HTTPError as exc:
            raise KVError(f"remote read failed: {exc}") from exc
        if resp.status_code != 200:
            raise KVError(f"remote read failed: {resp.text}")
        tokens: list[int] = resp.json()["tokens"][: max(0, n_tokens - first * self.cfg.block_size)]
        self.stats.remote_reads += 1
        moved = len(tokens) * self.cfg.kv_bytes_per_token
        self.stats.remote_pulled_bytes += moved
        if moved and self.cfg.pull_bytes_per_s > 0:
            await asyncio.sleep(moved / self.cfg.pull_bytes_per_s)
        return tokens

    def local_hit(self, prompt: list[int], cache_salt: str) -> tuple[list[int], list[int], int]:
        """The prompt's longest prefix in this engine's prefix cache (whole blocks, at most all but the last
        token, as vLLM's get_computed_blocks): its block ids (now referenced by the request), KV content, and
        chain hash. Nothing without prefix caching."""
        if not self.cfg.prefix_caching:
            return [], [], root_hash(cache_salt)
        self.kv.reap()
        ids, parent = self.kv.prefix_hit(prompt, len(prompt) - 1, cache_salt)
        self.kv.share(ids)
        return ids, [t for bid in ids for t in self.kv.blocks[bid]], parent

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list")
            if self.hf is not None:
                return self.hf.chat(body)
            return render_chat(msgs, self.cfg.vocab)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if any(not 0 <= t < self.cfg.vocab for t in prompt):
                raise ApiError(400, "token id out of vocabulary")
            return list(prompt)
        if isinstance(prompt, str):
            if self.hf is not None:
                return self.hf.text(prompt, bool(body.get("add_special_tokens", True)))
            return [BOS, *tokenize_text(prompt, self.cfg.vocab)]
        raise ApiError(400, "prompt must be a string or a list of token ids")

    async def compute_kv(
        self, prompt: list[int], params: dict[str, Any] | None, cached: list[int] | None = None
    ) -> tuple[list[int], int]:
        """The KV content this engine computes on, and how many tokens it pulled. ``cached``: the KV content of
        the prompt's prefix in this engine's own prefix cache (whole blocks): as in vLLM's scheduler, local hits
        count first and the connector is asked only for the rest."""
        cached = cached or []
        local = cached + prompt[len(cached) :]
        if not params:
            return local, 0
        if params.get("do_remote_prefill") and params.get("remote_block_ids"):
            n = min(int(params.get("remote_num_tokens") or len(prompt)), len(prompt))
            return await self._pull_or_recompute(prompt, params, n, cached)
        if (
            params.get("do_remote_decode")
            and params.get("remote_block_ids")
            and all(k in params for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"))
        ):
            if self.connector is not None and self.connector.offer_problem(params, prompt, accepted_at=time.time()):
                return local, 0  # declined: computed here, never loaded for tokens nobody verified
            n = min(int(params.get("remote_num_tokens") or 0), len(prompt))
            if n <= 0 or (self.cfg.kv_recompute_threshold and 0 < n - len(cached) < self.cfg.kv_recompute_threshold):
                return local, 0
            return await self._pull_or_recompute(prompt, params, n, cached)
        return local, 0

    async def _pull_or_recompute(
        self, prompt: list[int], params: dict[str, Any], n: int, cached: list[int]
    ) -> tuple[list[int], int]:
        local = cached + prompt[len(cached) :]
        if self.cfg.read_delay_s and params.get("do_remote_decode"):
            from kvbridge import offers  # the API package: only a prefill pulling a connector's offer needs it

            deadline = offers.read_deadline(params, time.time())
            await asyncio.sleep(self.cfg.read_delay_s)
            if deadline is not None and offers.too_late(deadline, time.time()):
                if self.connector is not None:
                    self.connector.declined["offer_expired"] = self.connector.declined.get("offer_expired", 0) + 1
                return local, 0  # vLLM's worker declines a READ this late: P computes
        try:
            pulled = await self.pull(params, n, start=len(cached))
        except KVError as exc:
            if self.cfg.kv_load_failure_policy == "recompute":
                return local, 0
            raise ApiError(500, f"KV load failed: {exc}") from exc
        self.stats.remote_pulled_tokens += len(pulled)
        have = cached + pulled
        return have + prompt[len(have) :], len(pulled)

    def finish_params(
        self, kv: list[int], is_p: bool, request_id: str, computed: int, head: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """What request_finished returns: P's params for D, or D's retained blocks (bidirectional). ``head``: the
        request's prefix-cache hit (its blocks are kept, the rest stored after them) and token ids."""
        if not is_p and not self.cfg.bidirectional:
            return None
        shared: list[int] = head.pop("shared", []) if head is not None else []
        if self.cfg.prefix_caching and head is not None:
            hit = len(shared) * self.cfg.block_size
            ids = head["token_ids"]
            block_ids = shared + self.kv.store(kv[hit:computed], ids[hit:computed], head["parent"])
        else:
            block_ids = self.kv.store(kv[:computed])
        ttl = self.cfg.kv_lease_duration if is_p else self.cfg.decoder_kv_blocks_ttl
        deadline = self.kv.hold(request_id, block_ids, ttl)
        retained = False
        if not is_p and self.connector is not None and head is not None:
            conversation = self.connector.conversation(head["params"], accepted_at=head["accepted_at"])
            if conversation is not None:
                held = self.kv.held[request_id]
                kept = self.connector.retain(
                    request_id,
                    conversation,
                    block_ids,
                    head["token_ids"][:computed],
                    head["cache_salt"],
                    free_blocks=self.kv.available() if self.cfg.admission else None,
                    waiting_blocks=next(iter(self.waiting.values()), 0),
                )
                if kept is None:  # not retained (memory pressure): freed now, nothing to read back
                    self.kv.release(request_id)
                    return None
                held.multi_use, retained = True, True
                held.deadline = kept
        params: dict[str, Any] = {
            "do_remote_prefill": is_p,
            "do_remote_decode": not is_p,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.cfg.host,
            "remote_port": self.cfg.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "remote_blocks_expiry_time": None if is_p else deadline,
            "transfer_mode": "pull",
        }
        if retained:  # as the connector marks it: the lease, not a fixed time, bounds reuse
            params["kvbridge_retained"] = True  # kvbridge_connector.params.RETAINED
            params["remote_blocks_expiry_time"] = None
        return params

    async def run(self, body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        """Validates and prefills; returns the response head and an iterator of generated steps."""
        self.stats.requests += 1
        accepted_at = time.time()
        self.sync_connector()
        self.stats.bodies_seen = [*self.stats.bodies_seen[-49:], body]
        if self.fail_next > 0:
            self.fail_next -= 1
            raise ApiError(500, "injected failure")
        model = body.get("model")
        if model != self.cfg.model and model not in self.cfg.lora_adapters:
            raise ApiError(404, f"The model `{model}` does not exist.")
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, "kv_transfer_params must be an object")
        self.stats.last_kv_transfer_params = params
        self.stats.kv_transfer_params_seen = [*self.stats.kv_transfer_params_seen[-49:], params]
        prompt = self.prompt_ids(body, chat)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, "max_tokens must be a positive integer")
        if len(prompt) + max_tokens > self.cfg.max_model_len:
            raise ApiError(400, "prompt too long")
        is_p = bool(params and params.get("do_remote_decode"))
        request_id = f"{'cmpl' if not chat else 'chatcmpl'}-{uuid.uuid4().hex}"
        salt = str(body.get("cache_salt") or "")
        if self.cfg.admission:
            await self.admit(request_id, prompt, max_tokens, salt)
        shared, cached, parent = self.local_hit(prompt, salt)
        reserved = 0
        if self.cfg.admission:
            # The blocks it stores at its end: all but the prefix-cache hit (a retained entry's blocks too), shared.
            reserved = -(-(len(prompt) + max_tokens) // self.cfg.block_size) - len(shared)
            self.kv.reserved += reserved
        try:
            kv, pulled = await self.compute_kv(prompt, params, cached)
        except BaseException:
            self.kv.free(shared)
            self.kv.reserved -= reserved
            raise
        head = {
            "request_id": request_id,
            "prompt": prompt,
            "pulled": pulled,
            "hit": len(cached),
            "shared": shared,
            "parent": parent,
            "is_p": is_p,
            "max_tokens": max_tokens,
            "params": params,
            "accepted_at": accepted_at,
            "cache_salt": str(body.get("cache_salt") or ""),
            "reserved": reserved,
        }
        self.stats.local_hit_tokens += len(cached)
        self.stats.computed_tokens += len(prompt) - pulled - len(cached)
        return head, self._generate(kv, prompt, pulled, max_tokens, head)

    async def _generate(
        self, kv: list[int], prompt: list[int], pulled: int, max_tokens: int, head: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        self.stats.running += 1
        try:
            prefill_s = (len(prompt) - pulled - head["hit"]) * self.cfg.prefill_us_per_token / 1e6
            if self.cfg.serialize_compute:
                async with self.compute:
                    await asyncio.sleep(prefill_s)
            else:
                await asyncio.sleep(prefill_s)
            seq = list(kv)
            out: list[int] = []
            for i, tok in enumerate(greedy_tokens(kv, max_tokens, self.cfg.vocab)):
                if i:
                    if self.cfg.serialize_compute:
                        async with self.compute:  # a decode step waits for the prefill running now
                            pass
                    await asyncio.sleep(self.cfg.decode_us_per_token / 1e6)
                if self.cfg.stall_s and i == self.cfg.stall_after_tokens:
                    self.stats.stalled += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.unstall.wait(), self.cfg.stall_s)
                if i == 0:
                    head["first_token_time"] = time.time()
                out.append(tok)
                seq.append(tok)
                yield {"token": tok, "last": i == max_tokens - 1}
            computed = len(seq) - 1 if not head["is_p"] else len(prompt)
            head["token_ids"] = prompt + out
            self.unreserve(head)  # the blocks it took become the ones it stores
            head["final_params"] = (
                self.finish_params(seq, head["is_p"], head["request_id"], computed, head) if head["params"] else None
            )
        finally:
            self.stats.running -= 1
            self.unreserve(head)
            self.kv.free(head.pop("shared", []))  # a prefix hit no retained state took over


# ---- HTTP --------------------------------------------------------------------------------


async def _collect(steps: AsyncIterator[dict[str, Any]]) -> list[int]:
    return [s["token"] async for s in steps]


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, list[int]]) -> list[int] | None:
    """``work``'s result, or None after cancelling it when the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        watcher.cancel()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalError", "code": status}},
        status_code=status,
    )


def build_app(cfg: SimConfig) -> tuple[Starlette, Engine]:
    engine = Engine(cfg)

    async def read_json(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise ApiError(400, "malformed JSON") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object")
        return body

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            head, steps = await engine.run(body, chat)
        except ApiError as exc:
            return _error(exc.status, exc.message)
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _sse(head, steps, chat, created, want_ids, include_usage, body["model"], engine.detok),
                media_type="text/event-stream",
            )
        tokens = await _unless_disconnected(request, _collect(steps))
        if tokens is None:  # like vLLM's with_cancellation: the client left, the request is aborted
            engine.stats.cancelled += 1
            return Response(status_code=499)
        text = "".join(engine.detok(t) for t in tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None, "stop_reason": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if want_ids:
            choice["token_ids"] = tokens
        resp: dict[str, Any] = {
            "id": head["request_id"],
            "object": obj,
            "created": created,
            "model": body["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(head["prompt"]),
                "completion_tokens": len(tokens),
                "total_tokens": len(head["prompt"]) + len(tokens),
                "prompt_tokens_details": {"cached_tokens": head["pulled"] + head["hit"]},
            },
            "kv_transfer_params": head.get("final_params") if cfg.kv_connector else None,
        }
        if cfg.report_timing:
            resp["sim_timing"] = {
                "first_token_time": head.get("first_token_time"),
                "local_hit_tokens": head["hit"],
                "pulled_tokens": head["pulled"],
                "computed_tokens": len(head["prompt"]) - head["pulled"] - head["hit"],
            }
        if want_ids:
            if chat:
                resp["prompt_token_ids"] = head["prompt"]
            else:
                choice["prompt_token_ids"] = head["prompt"]
        if head["is_p"] and resp["kv_transfer_params"] is not None:
            # vLLM 0.32: P's cache hits, pulled and local (scheduler.py, prefill_stats.num_cached_tokens).
            resp["kv_transfer_params"]["remote_prefill_cached_tokens"] = head["pulled"] + head["hit"]
        return JSONResponse(resp)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def tokenize(request: Request) -> Response:
        if engine.fail_tokenize > 0:
            engine.fail_tokenize -= 1
            return _error(503, "tokenizer unavailable")
        try:
            body = await read_json(request)
            if "messages" in body:
                msgs = body["messages"]
                if not isinstance(msgs, list):
                    raise ApiError(400, "messages must be a list")
                if engine.hf is not None:
                    ids = engine.hf.chat(body)
                else:
                    ids = render_chat(msgs, cfg.vocab, bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str) and engine.hf is not None:
                ids = engine.hf.text(body["prompt"], bool(body.get("add_special_tokens", True)))
            elif isinstance(body.get("prompt"), str):
                add_special = bool(body.get("add_special_tokens", True))
                ids = ([BOS] if add_special else []) + tokenize_text(body["prompt"], cfg.vocab)
            else:
                raise ApiError(400, "need prompt or messages")
        except ApiError as exc:
            return _error(exc.status, exc.message)
        return JSONResponse({"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids})

    async def models(_: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "engine-sim",
                        "max_model_len": cfg.max_model_len,
                        "parent": None,
                    },
                    *(
                        {
                            "id": name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "engine-sim",
                            "max_model_len": cfg.max_model_len,
                            "parent": cfg.model,
                        }
                        for name in cfg.lora_adapters
                    ),
                ],
            }
        )

    async def health(_: Request) -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    async def metrics(_: Request) -> Response:
        labels = f'engine="0",model_name="{cfg.model}"'
        lines = [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {engine.kv.usage()}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {engine.stats.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0",
            "# TYPE sim:remote_pulled_tokens_total counter",
            f"sim:remote_pulled_tokens_total{{{labels}}} {engine.stats.remote_pulled_tokens}",
        ]
        if cfg.cache_config_info:
            # vLLM: CacheConfig.metrics_info() (every field as a string) plus the engine index.
            info = f'block_size="{cfg.block_size}",cache_dtype="auto",enable_prefix_caching="{cfg.prefix_caching}"'
            lines += [
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{{info},engine="0"}} 1.0',
            ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def nixl_read(request: Request) -> Response:
        body = await request.json()
        if body.get("engine_id") not in (None, engine.engine_id):
            return _error(404, "engine id mismatch")
        if engine.fail_reads > 0:
            engine.fail_reads -= 1
            return _error(503, "NIXL transfer failed")
        engine.sync_connector()
        try:
            tokens = engine.kv.read(str(body["request_id"]), [int(b) for b in body["block_ids"]])
        except KVError as exc:
            return _error(410, str(exc))
        return JSONResponse({"tokens": tokens})

    async def stats(_: Request) -> Response:
        s = engine.stats
        return JSONResponse(
            {
                "engine_id": engine.engine_id,
                "requests": s.requests,
                "remote_pulled_tokens": s.remote_pulled_tokens,
                "remote_pulled_bytes": s.remote_pulled_bytes,
                "remote_reads": s.remote_reads,
                "kvbridge": (
                    {
                        "registered": engine.connector.registered,
                        "declined": dict(engine.connector.declined),
                        "not_retained": dict(engine.connector.not_retained),
                        "withdrawal_batches": list(engine.connector.withdrawal_batches),
                    }
                    if engine.connector is not None
                    else None
                ),
                "local_hit_tokens": s.local_hit_tokens,
                "computed_tokens": s.computed_tokens,
                "running": s.running,
                "stalled": s.stalled,
                "cancelled": s.cancelled,
                "admission": {
                    "waits": s.admission_waits,
                    "wait_max_s": s.admission_wait_max_s,
                    "wait_total_s": s.admission_wait_total_s,
                },
                "held_requests": sorted(engine.kv.held),
                "unsafe_reads": engine.kv.unsafe_reads,
                "last_kv_transfer_params": s.last_kv_transfer_params,
                "kv_transfer_params_seen": s.kv_transfer_params_seen,
                "bodies_seen": s.bodies_seen,
            }
        )

    async def control(request: Request) -> Response:
        body = await request.json()
        engine.fail_next = int(body.get("fail_next", engine.fail_next))
        engine.fail_tokenize = int(body.get("fail_tokenize", engine.fail_tokenize))
        engine.fail_reads = int(body.get("fail_reads", engine.fail_reads))
        engine.healthy = bool(body.get("healthy", engine.healthy))
        if body.get("expire_all"):
            for held in engine.kv.held.values():
                held.deadline = 0.0
            engine.kv.reap()
        if "decode_us_per_token" in body:
            cfg.decode_us_per_token = float(body["decode_us_per_token"])
        if "stall_s" in body:
            cfg.stall_s = float(body["stall_s"])
            cfg.stall_after_tokens = int(body.get("stall_after_tokens", 0))
            if cfg.stall_s:
                engine.unstall.clear()
            else:
                engine.unstall.set()
        return JSONResponse({"ok": True})

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/nixl/read", nixl_read, methods=["POST"]),
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/control", control, methods=["POST"]),
    ]
    return Starlette(routes=routes), engine


async def _sse(
    head: dict[str, Any],
    steps: AsyncIterator[dict[str, Any]],
    chat: bool,
    created: int,
    want_ids: bool,
    include_usage: bool,
    model: str,
    detok: Callable[[int], str] = detokenize,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = 0

    def frame(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    if chat:
        first: dict[str, Any] = {
            "id": head["request_id"],
            "object": obj,
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        if want_ids:
            first["prompt_token_ids"] = head["prompt"]
        yield frame(first)
    async for step in steps:
        n += 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if step["last"] else None}
        if chat:
            choice["delta"] = {"content": detok(step["token"])}
        else:
            choice["text"] = detok(step["token"])
            if want_ids and n == 1:
                choice["prompt_token_ids"] = head["prompt"]
        if want_ids:
            choice["token_ids"] = [step["token"]]
        yield frame({"id": head["request_id"], "object": obj, "created": created, "model": model, "choices": [choice]})
    if include_usage:
        yield frame(
            {
                "id": head["request_id"],
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": {
                    "prompt_tokens": len(head["prompt"]),
                    "completion_tokens": n,
                    "total_tokens": len(head["prompt"]) + n,
                },
            }
        )
    yield b"data: [DONE]\n\n"


# ---- running it --------------------------------------------------------------------------


class SimServer:
    """Runs a simulator in the current event loop (for tests): ``async with SimServer(cfg) as sim``."""

    def __init__(self, cfg: SimConfig) -> None:
        # Bound here and handed to uvicorn: a port picked free and bound later could be taken meanwhile (by a
        # parallel test), and uvicorn answers a failed bind with SystemExit, which breaks the test runner's loop.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the same port
        self._socket.bind((cfg.host, cfg.port or 0))
        cfg.port = int(self._socket.getsockname()[1])
        self.cfg = cfg
        self.app, self.engine = build_app(cfg)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host=cfg.host, port=cfg.port, log_level="warning", lifespan="off")
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    async def __aenter__(self) -> SimServer:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.unstall.set()  # a hung generation must not hold up the shutdown
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close()
        await self.engine.http.aclose()
        if self.engine.connector is not None:
            await asyncio.to_thread(self.engine.connector.stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.tools.engine_sim",
        description="vLLM OpenAI-server stand-in speaking the P/D kv_transfer_params protocol (a test tool).",
    )
    parser.add_argument("--role", choices=["prefill", "decode", "both"], default="decode")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--engine-id", default="")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--total-blocks", type=int, default=4096)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=SimConfig.max_model_len,
        help="longest prompt + max_tokens accepted (vLLM's --max-model-len)",
    )
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0)
    parser.add_argument("--kv-recompute-threshold", type=int, default=0)
    parser.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0)
    parser.add_argument("--decode-us-per-token", type=float, default=0.0)
    parser.add_argument(
        "--stall-s", type=float, default=0.0, help="slow/hung engine: pause each generation this long (0: never)"
    )
    parser.add_argument(
        "--stall-after-tokens",
        type=int,
        default=0,
        help="where the pause happens: after this many output tokens (0: before the first)",
    )
    parser.add_argument(
        "--hf-tokenizer", default="", help="directory with HF tokenizer files: tokenize and render chat prompts with it"
    )
    parser.add_argument("--prefix-caching", action="store_true", help="model vLLM's automatic prefix caching")
    parser.add_argument("--kv-bytes-per-token", type=int, default=0, help="KV bytes a pulled token moves")
    parser.add_argument("--pull-bytes-per-s", type=float, default=0.0, help="pull bandwidth (0: instant)")
    parser.add_argument(
        "--serialize-compute", action="store_true", help="one compute unit: prefills queue, decode steps wait for them"
    )
    parser.add_argument("--report-timing", action="store_true", help="responses carry sim_timing")
    parser.add_argument(
        "--kvbridge-config",
        type=json.loads,
        default={},
        help="JSON: the kvbridge connector's kv_connector_extra_config; with kvbridge_registry the engine runs the "
        "connector's control plane (connector mode, tests/tools/sim_connector.py)",
    )
    parser.add_argument(
        "--no-cache-config-info",
        action="store_true",
        help="/metrics without vllm:cache_config_info (an engine that does not state its block size)",
    )
    parser.add_argument(
        "--no-kv-connector",
        action="store_true",
        help='a stock vLLM without --kv-transfer-config: responses carry "kv_transfer_params": null',
    )
    a = parser.parse_args(argv)
    cfg = SimConfig(
        role=a.role,
        model=a.model,
        engine_id=a.engine_id,
        host=a.host,
        port=a.port,
        block_size=a.block_size,
        total_blocks=a.total_blocks,
        max_model_len=a.max_model_len,
        vocab=a.vocab,
        decoder_kv_blocks_ttl=a.decoder_kv_blocks_ttl,
        kv_recompute_threshold=a.kv_recompute_threshold,
        kv_load_failure_policy=a.kv_load_failure_policy,
        prefill_us_per_token=a.prefill_us_per_token,
        decode_us_per_token=a.decode_us_per_token,
        stall_s=a.stall_s,
        stall_after_tokens=a.stall_after_tokens,
        hf_tokenizer=a.hf_tokenizer,
        prefix_caching=a.prefix_caching,
        kv_bytes_per_token=a.kv_bytes_per_token,
        pull_bytes_per_s=a.pull_bytes_per_s,
        serialize_compute=a.serialize_compute,
        report_timing=a.report_timing,
        kvbridge_config=a.kvbridge_config,
        cache_config_info=not a.no_cache_config_info,
        kv_connector=not a.no_kv_connector,
    )
    if a.kvbridge_config.get("kvbridge_registry") and not a.port:
        parser.error("--kvbridge-config registers this engine's address: give it a --port")
    app, _ = build_app(cfg)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
