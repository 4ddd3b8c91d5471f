"""Tenant isolation with real API keys: tenant B (globex) never learns of or reuses tenant A's (acme) entries.

By key (lookup/get/list/delete/watch), by prefix content (content-addressed lookup with A's exact tokens),
through the gateway (B sends A's conversation id), and with no oracle in B's responses: every answer B
gets about a key is byte-identical whether or not A holds that key.
"""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge.errors import KvbridgeError, Reason
from kvbridge.registry.v1 import registry_pb2

from .conftest import ACME_KEY, BLOCK, GATEWAY_KEY, GLOBEX_KEY, MODEL, OPERATOR_KEY, SecureStack, call, chain, md

TOKENS = list(range(20, 20 + 8 * BLOCK))
LONG = " ".join(f"w{i}" for i in range(100, 200))


def _key(tenant: str, conv: str) -> registry_pb2.EntryKey:
    return registry_pb2.EntryKey(tenant=tenant, model=MODEL, conversation_key=conv)


async def _observe(stack: SecureStack, conv: str) -> list[Any]:
    """Everything globex can observe about ``conv``: response bytes, or (code, reason, details, trailers)."""
    reg = stack.registry
    probes: list[tuple[Any, Any]] = [
        (
            reg.LookupEntry,
            registry_pb2.LookupEntryRequest(
                model=MODEL, conversation_key=conv, block_hashes=chain(TOKENS, "acme"), block_size=BLOCK
            ),
        ),
        (
            reg.LookupEntry,
            registry_pb2.LookupEntryRequest(
                model=MODEL, conversation_key=conv, block_hashes=chain(TOKENS, "globex"), block_size=BLOCK
            ),
        ),
        (
            reg.LookupEntry,
            registry_pb2.LookupEntryRequest(model=MODEL, block_hashes=chain(TOKENS, "globex"), block_size=BLOCK),
        ),
        (
            reg.LookupEntry,
            registry_pb2.LookupEntryRequest(
                tenant="acme", model=MODEL, conversation_key=conv, block_hashes=chain(TOKENS, "acme"), block_size=BLOCK
            ),
        ),
        (reg.GetEntry, registry_pb2.GetEntryRequest(key=_key("", conv))),
        (reg.GetEntry, registry_pb2.GetEntryRequest(key=_key("acme", conv))),
        (reg.DeleteEntry, registry_pb2.DeleteEntryRequest(key=_key("", conv))),
        (reg.DeleteEntry, registry_pb2.DeleteEntryRequest(key=_key("acme", conv))),
        (reg.ListEntries, registry_pb2.ListEntriesRequest(model=MODEL)),
        (reg.ListEntries, registry_pb2.ListEntriesRequest(tenant="acme")),
    ]
    seen: list[Any] = []
    for fn, req in probes:
        try:
            resp = await fn(req, metadata=md(GLOBEX_KEY), timeout=5)
            seen.append(resp.SerializeToString(deterministic=True))
        except grpc.aio.AioRpcError as exc:
            trailers = sorted((k, v) for k, v in (exc.trailing_metadata() or ()) if not k.startswith("grpc-"))
            seen.append((exc.code(), exc.details(), trailers))
    return seen


async def test_no_oracle_in_responses(secure: SecureStack) -> None:
    """B's view of a key is byte-identical before and after A registers that key."""
    before = await _observe(secure, "c-probe")
    await secure.register("acme", "c-probe", TOKENS)
    after = await _observe(secure, "c-probe")
    assert before == after
    assert len(secure.registry_app.index.entries) == 1  # A's entry survived B's delete attempts


async def test_by_key_every_rpc(secure: SecureStack) -> None:
    await secure.register("acme", "c1", TOKENS)
    reg = secure.registry
    look = await call(
        reg.LookupEntry,
        registry_pb2.LookupEntryRequest(
            model=MODEL, conversation_key="c1", block_hashes=chain(TOKENS, "acme"), block_size=BLOCK
        ),
        GLOBEX_KEY,
    )
    assert look.verdict == registry_pb2.LOOKUP_VERDICT_NOT_FOUND and not look.HasField("location")
    # Naming another tenant in a lookup: the servicer refuses (the credentials bind the tenant).
    with pytest.raises(KvbridgeError) as info:
        await call(
            reg.LookupEntry,
            registry_pb2.LookupEntryRequest(tenant="acme", model=MODEL, conversation_key="c1", block_size=BLOCK),
            GLOBEX_KEY,
        )
    assert info.value.reason == Reason.TENANT_FORBIDDEN.value and info.value.metadata.get("field") == "tenant"
    # Reading, listing, deleting and watching entries are not tenant RPCs at all (the authorization table),
    # whichever tenant the request names.
    for fn, req in (
        (reg.GetEntry, registry_pb2.GetEntryRequest(key=_key("acme", "c1"))),
        (reg.GetEntry, registry_pb2.GetEntryRequest(key=_key("", "c1"))),
        (reg.DeleteEntry, registry_pb2.DeleteEntryRequest(key=_key("acme", "c1"))),
        (reg.ListEntries, registry_pb2.ListEntriesRequest(tenant="acme")),
        (reg.ListEntries, registry_pb2.ListEntriesRequest()),
    ):
        with pytest.raises(KvbridgeError) as info:
            await call(fn, req, GLOBEX_KEY)
        assert info.value.reason == Reason.TENANT_FORBIDDEN.value and "method" in info.value.metadata
    for tenant in ("acme", ""):
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in reg.WatchEntries(registry_pb2.WatchEntriesRequest(tenant=tenant), metadata=md(GLOBEX_KEY)):
                pass
        assert raw.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Acme's entry is intact, and a gateway-role watch scoped to globex never carries acme's entries.
    stream = reg.WatchEntries(
        registry_pb2.WatchEntriesRequest(tenant="globex", progress_interval=Duration(nanos=300_000_000)),
        metadata=md(GATEWAY_KEY),
        timeout=5,
    )
    messages = 0
    async for msg in stream:
        assert all(ev.entry.key.tenant != "acme" for ev in msg.events)
        messages += 1
        if messages == 1:
            await secure.register("acme", "c2", TOKENS)
        if messages >= 3:
            stream.cancel()
            break
    mine = await call(reg.ListEntries, registry_pb2.ListEntriesRequest(tenant="acme"), OPERATOR_KEY)
    assert {e.key.conversation_key for e in mine.entries} == {"c1", "c2"}


async def test_by_prefix_content(secure: SecureStack) -> None:
    """B computes A's exact token prefix (content-addressed lookup, no key): B's chain is scoped by B's tenant."""
    await secure.register("acme", "c1", TOKENS)
    for hashes in (chain(TOKENS, "globex"), chain(TOKENS, "acme")):
        look = await call(
            secure.registry.LookupEntry,
            registry_pb2.LookupEntryRequest(model=MODEL, block_hashes=hashes, block_size=BLOCK),
            GLOBEX_KEY,
        )
        assert look.verdict == registry_pb2.LOOKUP_VERDICT_NOT_FOUND, look
    # Control: A's own content lookup does find it, so the negative above is not vacuous.
    look = await call(
        secure.registry.LookupEntry,
        registry_pb2.LookupEntryRequest(model=MODEL, block_hashes=chain(TOKENS, "acme"), block_size=BLOCK),
        ACME_KEY,
    )
    assert look.verdict == registry_pb2.LOOKUP_VERDICT_HIT


async def _chat(client: httpx.AsyncClient, messages: list[dict[str, str]], conv: str) -> tuple[str, str]:
    r = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8, "conversation_id": conv}
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["x-kvbridge-reuse"]


async def _reference(stack: SecureStack, messages: list[dict[str, str]]) -> str:
    async with httpx.AsyncClient() as c:
        r = await c.post(
            stack.decode.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}
        )
    return str(r.json()["choices"][0]["message"]["content"])


async def test_gateway_conversation_id_is_per_tenant(secure: SecureStack) -> None:
    msgs = [{"role": "user", "content": LONG}]
    async with secure.http(ACME_KEY) as acme, secure.http(GLOBEX_KEY) as globex:
        answer, _ = await _chat(acme, msgs, "shared-id")
        await secure.settle()
        follow = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "more please"}]
        _, verdict = await _chat(acme, follow, "shared-id")
        await secure.settle()
        assert verdict.startswith("hit;"), verdict  # A reuses its own KV
        pulled = secure.prefill.engine.stats.remote_pulled_tokens
        # B sends A's conversation id with A's exact history: no reuse, and the correct answer.
        follow2 = [*follow, {"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]
        b_answer, b_verdict = await _chat(globex, follow2, "shared-id")
        assert b_verdict.startswith("miss;"), b_verdict
        assert secure.prefill.engine.stats.remote_pulled_tokens == pulled
        assert b_answer == await _reference(secure, follow2)
        await secure.settle()
        # B's turn registered under B's tenant; A's entry is untouched and still serves A.
        entries = {(k[0], k[2]) for k in secure.registry_app.index.entries}
        assert ("acme", "shared-id") in entries
        _, a_verdict = await _chat(acme, follow2, "shared-id")
        assert a_verdict.startswith("hit;"), a_verdict
