"""Greedy completion turns through a gateway over real vLLM engines, shared by the e2e gateway tests."""

from __future__ import annotations

import asyncio
import random

import httpx

from kvbridge_services.gateway.app import GatewayApp


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
