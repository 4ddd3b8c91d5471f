"""Per-tenant prefix-cache isolation (issue 30, item 5): every engine request carries a cache_salt derived from
the tenant and the client's own cache_salt, keyed by the deployment secret. Another tenant's identical prompt
finds nothing in the engines' prefix caches (no timing oracle), and reuse within a tenant still hits, in
compatibility and connector mode (the gateway's chain, D's connector and P's check agree on the salt)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvbridge_services.gateway.kvparams import ENGINE_CACHE_SALT_PREFIX
from tests.fixtures.gateway_stack import LONG, Stack, chat, reference, running_stack, turn
from tests.tools.engine_sim import SimServer


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        yield s


def _globex(stack: Stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=stack.gateway.http_url, headers={"authorization": "Bearer key-globex"}, timeout=30
    )


def _last_salt(sim: SimServer) -> str:
    body: dict[str, Any] = sim.engine.stats.bodies_seen[-1]
    return str(body["cache_salt"])


async def _salts(stack: Stack, client: httpx.AsyncClient, conv: str, **extra: object) -> tuple[str, str]:
    """The cache_salt P and D got for one turn."""
    r = await client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hello"}], conv, **extra))
    assert r.status_code == 200, r.text
    await stack.settle()
    return _last_salt(stack.prefill), _last_salt(stack.decode)


async def test_p_and_d_get_one_salt_per_tenant_and_client_salt(stack: Stack) -> None:
    async with _globex(stack) as globex:
        acme_plain = await _salts(stack, stack.client, "a1")
        acme_again = await _salts(stack, stack.client, "a2")
        acme_salted = await _salts(stack, stack.client, "a3", cache_salt="s1")
        globex_plain = await _salts(stack, globex, "g1")
        globex_salted = await _salts(stack, globex, "g2", cache_salt="s1")
    for p_salt, d_salt in (acme_plain, acme_salted, globex_plain, globex_salted):
        assert p_salt == d_salt  # P and D agree (D's connector hashes under this salt; P's cache is salted alike)
        assert p_salt.startswith(ENGINE_CACHE_SALT_PREFIX)
        assert "acme" not in p_salt and "globex" not in p_salt and "s1" not in p_salt[len(ENGINE_CACHE_SALT_PREFIX) :]
    assert acme_plain == acme_again  # stable for a tenant: its own prefix cache and reuse keep working
    assert len({acme_plain[0], acme_salted[0], globex_plain[0], globex_salted[0]}) == 4


async def test_no_prefix_cache_hit_across_tenants(stack: Stack) -> None:
    """globex sends acme's document: the engines' prefix caches serve it nothing (acme's own resend is a hit)."""
    for sim in (stack.prefill, stack.decode):
        sim.engine.cfg.prefix_caching = True
    doc = [{"role": "user", "content": LONG}]
    await turn(stack, doc, conv="acme-doc")
    p_hits, d_hits = stack.prefill.engine.stats.local_hit_tokens, stack.decode.engine.stats.local_hit_tokens
    async with _globex(stack) as globex:  # the same client salt as acme's (none), and acme's conversation id
        answer, verdict = await turn(stack, doc, conv="acme-doc", client=globex)
    assert verdict == "miss;tokens=0"
    assert stack.prefill.engine.stats.local_hit_tokens == p_hits
    assert stack.decode.engine.stats.local_hit_tokens == d_hits
    assert answer == await reference(stack, doc)
    # Control: the same document from acme under a new conversation hits P's prefix cache (whole blocks, all but
    # the last token), so the engines would have shared it without the per-tenant salt.
    await turn(stack, doc, conv="acme-doc-2")
    assert stack.prefill.engine.stats.local_hit_tokens > p_hits


async def _reuse_within_tenant(stack: Stack, salt: str) -> None:
    msgs = [{"role": "user", "content": LONG}]
    answer, verdict = await turn(stack, msgs, cache_salt=salt)
    assert verdict == "miss;tokens=0"
    for i in range(2):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}"}]
        answer, verdict = await turn(stack, msgs, cache_salt=salt)
        assert verdict.startswith("hit;tokens="), verdict
        assert int(verdict.split("=")[1]) >= 64
        assert answer == await reference(stack, msgs)
    # Another client salt is another cache: the same history under it reuses nothing.
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "once more"}]
    _, verdict = await turn(stack, msgs, cache_salt=salt + "-other")
    assert not verdict.startswith("hit"), verdict


@pytest.mark.parametrize("salt", ["", "client-salt"])
async def test_reuse_within_a_tenant_hits_in_compatibility_mode(stack: Stack, salt: str) -> None:
    await _reuse_within_tenant(stack, salt)


@pytest.mark.parametrize("salt", ["", "client-salt"])
async def test_reuse_within_a_tenant_hits_in_connector_mode(salt: str) -> None:
    async with running_stack(connector_mode=True) as s:
        await _reuse_within_tenant(s, salt)
        assert (await s.sim_stats(s.decode))["unsafe_reads"] == 0
