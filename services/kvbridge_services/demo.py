"""The README's multi-turn demo, against a running registry + lease manager.

It plays a decode engine the way the connector does (register the engine with
a node lease; after each turn register the retained KV under an entry lease)
and a gateway (hash the next prompt, look up the verified prefix), and prints
per turn what could be reused and why. Token ids come from a toy word-level
tokenizer: the demo shows the control plane, not a model.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.sdk import ClientOptions, Heartbeater, LeaseClient, RegistryClient
from kvbridge.types.v1 import types_pb2

MODEL = "demo-model"
BLOCK = 32
ENGINE_ID = "demo-decode-0"
SECRET = b"kvbridge-demo-secret-not-for-production"


def tokenize(text: str) -> list[int]:
    """Toy tokenizer: one stable id per word (vocab 50k)."""
    return [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % 50_000 for w in text.split()
    ]


def render(messages: list[tuple[str, str]]) -> list[int]:
    out: list[int] = []
    for role, content in messages:
        out += tokenize(f"<|{role}|> {content} <|end|>")
    return out


def _words(seed: str, n: int) -> str:
    return " ".join(f"{seed}{i}" for i in range(n))


@dataclass
class TurnReport:
    turn: str
    tenant: str
    conversation: str
    prompt_tokens: int
    verdict: str
    reused_tokens: int
    recomputed_tokens: int


class Demo:
    def __init__(self, registry: RegistryClient, lease: LeaseClient) -> None:
        self.registry = registry
        self.lease = lease
        self.heartbeater = Heartbeater(lease, interval_s=1.0)
        self.next_block = 0
        self.epochs: dict[tuple[str, str], int] = {}

    async def start_engine(self) -> None:
        node = await self.lease.grant(kind=lease_pb2.LEASE_KIND_NODE, engine_id=ENGINE_ID, ttl_s=10)
        self.heartbeater.add_lease(node.lease.lease_id)
        self.heartbeater.start()
        await self.registry.register_engine(
            types_pb2.Engine(
                engine_id=ENGINE_ID,
                role=types_pb2.ENGINE_ROLE_DECODE,
                model=MODEL,
                http_url="http://127.0.0.1:8200",
                kv_host="127.0.0.1",
                kv_port=5600,
                tp_size=1,
                pp_size=1,
                dcp_size=1,
                dp_size=1,
                block_size=BLOCK,
                kv_group_count=1,
                total_kv_blocks=4096,
                capabilities=["bidirectional_kv_xfer", "kvbridge_connector"],
                node_lease_id=node.lease.lease_id,
            )
        )

    async def lookup(self, tenant: str, conversation: str, tokens: list[int]) -> registry_pb2.LookupEntryResponse:
        chain = hashchain.chain(SECRET, tenant, MODEL, "", BLOCK, tokens)
        return await self.registry.lookup(
            tenant=tenant,
            model=MODEL,
            conversation_key=conversation,
            block_hashes=chain,
            block_size=BLOCK,
            min_tokens=BLOCK,
        )

    async def retain(self, tenant: str, conversation: str, tokens: list[int]) -> None:
        """What the connector does when decode finishes: lease + register the retained blocks."""
        n_blocks = len(tokens) // BLOCK
        epoch = self.epochs.get((tenant, conversation), 0) + 1
        self.epochs[(tenant, conversation)] = epoch
        grant = await self.lease.grant(
            kind=lease_pb2.LEASE_KIND_ENTRY,
            tenant=tenant,
            engine_id=ENGINE_ID,
            model=MODEL,
            conversation_key=conversation,
            retained_tokens=len(tokens),
            ttl_s=30,
            request_id=f"grant-{uuid.uuid4().hex}",
        )
        block_ids = list(range(self.next_block, self.next_block + n_blocks))
        self.next_block += n_blocks
        entry = registry_pb2.Entry(
            key=registry_pb2.EntryKey(tenant=tenant, model=MODEL, conversation_key=conversation),
            engine_id=ENGINE_ID,
            engine_request_id=f"cmpl-{uuid.uuid4().hex[:12]}",
            block_ids=[types_pb2.BlockIds(ids=block_ids)],
            block_size=BLOCK,
            token_count=n_blocks * BLOCK,
            block_hashes=hashchain.chain(SECRET, tenant, MODEL, "", BLOCK, tokens),
            lease_id=grant.lease.lease_id,
            epoch=epoch,
        )
        await self.registry.register_entry(f"reg-{uuid.uuid4().hex}", entry)
        self.heartbeater.add_lease(grant.lease.lease_id)

    async def turn(self, label: str, tenant: str, conversation: str, tokens: list[int]) -> TurnReport:
        found = await self.lookup(tenant, conversation, tokens)
        verdict = registry_pb2.LookupVerdict.Name(found.verdict).removeprefix("LOOKUP_VERDICT_").lower()
        reused = found.verified_tokens if found.verdict == registry_pb2.LOOKUP_VERDICT_HIT else 0
        conv = conversation or "(content)"
        return TurnReport(label, tenant, conv, len(tokens), verdict, reused, len(tokens) - reused)


async def run_demo(
    registry_addr: str,
    lease_addr: str,
    *,
    emit: Callable[[str], None] = print,
    as_json: bool = False,
    api_key: str | None = None,
) -> list[TurnReport]:
    opts = ClientOptions(api_key=api_key)
    async with RegistryClient(registry_addr, opts) as registry, LeaseClient(lease_addr, opts) as lease:
        demo = Demo(registry, lease)
        await demo.start_engine()
        reports: list[TurnReport] = []

        def show(r: TurnReport) -> None:
            reports.append(r)
            if not as_json:
                emit(
                    f"{r.turn:<34} {r.tenant:<7} {r.conversation:<14} {r.prompt_tokens:>6} "
                    f"{r.verdict:<15} {r.reused_tokens:>6} {r.recomputed_tokens:>6}"
                )

        if not as_json:
            emit(
                f"{'turn':<34} {'tenant':<7} {'conversation':<14} {'prompt':>6} "
                f"{'verdict':<15} {'reused':>6} {'recomp':>6}"
            )
        system = ("system", "You are a travel agent with tools. " + _words("policy", 560))
        first_ask = ("user", "Plan a week in Lisbon. " + _words("ask", 40))
        history: list[tuple[str, str]] = [system, first_ask]
        answers = [
            _words("plan", 90),
            _words("hotels", 70) + " <think> " + _words("reason", 60) + " </think>",
            _words("food", 80),
        ]
        for i, answer in enumerate(answers, start=1):
            tokens = render(history)
            show(await demo.turn(f"turn {i}", "acme", "trip-42", tokens))
            history.append(("assistant", answer))
            await demo.retain("acme", "trip-42", render(history))
            history.append(("user", _words(f"followup{i}-", 30)))
        # The client strips the reasoning from the previous answer before resending:
        # only the blocks before the edit are verified, the rest is recomputed.
        stripped = [(r, c.split(" <think> ")[0]) if "<think>" in c else (r, c) for r, c in history]
        show(await demo.turn("turn 4 (reasoning stripped)", "acme", "trip-42", render(stripped)))
        # Another tenant guessing the same conversation key gets nothing.
        show(await demo.turn("other tenant, same key", "globex", "trip-42", render(history)))
        # A new conversation sharing the system prompt: content-addressed lookup.
        fork = [system, ("user", "Plan a weekend in Porto. " + _words("porto", 20))]
        show(await demo.turn("new conversation, shared prefix", "acme", "", render(fork)))
        # Closing the conversation releases the decode-held KV at once.
        entry = await registry.get_entry("acme", MODEL, "trip-42")
        await lease.revoke(entry.lease_id)
        show(await demo.turn("after close", "acme", "trip-42", render(history)))
        await demo.heartbeater.stop()
        if as_json:
            emit(json.dumps([asdict(r) for r in reports], indent=2))
        return reports
