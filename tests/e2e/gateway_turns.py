"""Greedy completion turns through a gateway over real vLLM engines, shared by the e2e gateway tests."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import httpx

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.gateway.app import GatewayApp
from kvbridge_services.gateway.config import GatewaySettings
from tests.e2e.conftest import HASH_SECRET
from tests.fixtures.control_plane_procs import ControlPlaneProcs
from tests.fixtures.vllm_engines import BLOCK_SIZE


@contextlib.asynccontextmanager
async def registry_routed_gateway(
    procs: ControlPlaneProcs, *, reuse: bool, placement: bool = False, auth: Authenticator | None = None
) -> AsyncIterator[GatewayApp]:
    """A gateway with no engines configured (connector mode): it routes to the engines the registry lists, and
    is yielded once it lists a prefill and a decode engine (within 120 s, or the test fails)."""
    settings = GatewaySettings(
        http_port=0,
        grpc_port=0,
        registry_address=procs.registry_target,
        lease_address=procs.lease_target,
        hash_secret_hex=HASH_SECRET,
        default_block_size=BLOCK_SIZE,
        reuse_enabled=reuse,
        placement=placement,
        engines_from_registry=True,
        registry_refresh_s=1,
        health_timeout_s=10,
        control_timeout_s=10,
    )
    gw = GatewayApp(settings, auth=auth or Authenticator({}))
    await gw.start()
    try:
        deadline = time.monotonic() + 120
        while not gw.core.ready():  # the engines' own registrations, listed by the registry
            assert time.monotonic() < deadline, "the gateway never listed a prefill and a decode engine"
            await asyncio.sleep(0.2)
        yield gw
    finally:
        await gw.stop()


async def complete(
    c: httpx.AsyncClient,
    gw: GatewayApp,
    prompt: list[int],
    conv: str,
    *,
    max_tokens: int = 16,
    placements: list[str] | None = None,
) -> tuple[str, list[int]]:
    """One greedy completion turn through the gateway; its reuse verdict and output token ids (``placements``:
    gets the turn's placement header)."""
    r = await c.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "conversation_id": conv,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    await gw.core.router.drain()
    if placements is not None:
        placements.append(r.headers.get("x-kvbridge-placement", ""))
    return r.headers["x-kvbridge-reuse"], r.json()["choices"][0]["token_ids"]


async def conversation(
    gw: GatewayApp,
    conv: str,
    turns: int,
    placements: list[str] | None = None,
    *,
    headers: dict[str, str] | None = None,
    settle_s: float = 0.0,
) -> list[tuple[str, list[int]]]:
    """``turns`` turns of one conversation (200 random tokens, then each answer and 20 more); ``settle_s``: a pause
    after each turn (a connector registers the turn's entry on its own schedule)."""
    rng = random.Random(5)
    prompt = [rng.randrange(10, 500) for _ in range(200)]
    out = []
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=600, headers=headers) as c:
        for _ in range(turns):
            verdict, ids = await complete(c, gw, prompt, conv, max_tokens=24, placements=placements)
            out.append((verdict, ids))
            prompt = prompt + ids + [rng.randrange(10, 500) for _ in range(20)]
            await asyncio.sleep(settle_s)
    return out


async def prefix_cache_hits(url: str) -> float:
    """The engine's prefix-cache hits so far, in tokens (vLLM's ``vllm:prefix_cache_hits_total``)."""
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits"))
