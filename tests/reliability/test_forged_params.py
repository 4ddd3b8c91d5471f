"""Forged kv_transfer_params and forged engine endpoints: rejected or ignored; no SSRF.

A canary TCP server stands for an address an attacker wants the cluster to reach (cloud metadata, an
internal service). Client-supplied transfer params naming it, and engine records naming it registered by
a tenant principal, must never make any component connect to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from kvbridge.errors import KvbridgeError, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from .conftest import ACME_KEY, BLOCK, GLOBEX_KEY, MODEL, SECRET, SecureStack, call, chain

LONG = " ".join(f"w{i}" for i in range(100, 220))


class Canary:
    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])


@pytest.fixture
async def canary() -> AsyncIterator[Canary]:
    c = Canary()
    c.server = await asyncio.start_server(c._on_connect, "127.0.0.1", 0)
    try:
        yield c
    finally:
        c.server.close()
        await c.server.wait_closed()


def _forged(port: int, request_id: str = "victim-req") -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "d0",
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [[1, 2, 3, 4, 5, 6]],
        "remote_num_tokens": 96,
        "tp_size": 1,
    }


async def test_client_kv_transfer_params_are_stripped(secure: SecureStack, canary: Canary) -> None:
    msgs = [{"role": "user", "content": LONG}]
    known_ports = {secure.prefill.cfg.port, secure.decode.cfg.port}
    async with secure.http(ACME_KEY) as client:
        for stream in (False, True):
            for params in (
                _forged(canary.port),
                {"do_remote_decode": True, "remote_host": "169.254.169.254"},
                "not-an-object",
                [1, 2],
            ):
                body = {
                    "model": MODEL,
                    "messages": msgs,
                    "max_tokens": 4,
                    "conversation_id": "c-forge",
                    "kv_transfer_params": params,
                    "stream": stream,
                }
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                await secure.settle()
                if not stream:
                    assert r.json().get("kv_transfer_params") is None  # internal params never go back out
                    assert "kv_transfer_params" not in r.text
    assert canary.connections == 0
    for sim in (secure.prefill, secure.decode):
        for seen in sim.engine.stats.kv_transfer_params_seen:
            if seen and seen.get("remote_port") is not None:
                assert seen.get("remote_host") == "127.0.0.1" and seen["remote_port"] in known_ports, seen
            assert not seen or seen.get("remote_request_id") != "victim-req"


async def test_tenant_cannot_register_engines(secure: SecureStack, canary: Canary) -> None:
    engines_before = set(secure.registry_app.index.engines)
    rogue = types_pb2.Engine(
        engine_id="rogue",
        role=types_pb2.ENGINE_ROLE_DECODE,
        model=MODEL,
        http_url=f"http://127.0.0.1:{canary.port}",
        kv_host="127.0.0.1",
        kv_port=canary.port,
        dp_size=1,
        tp_size=1,
        block_size=BLOCK,
        kv_group_count=1,
    )
    for key in (ACME_KEY, GLOBEX_KEY):
        with pytest.raises(KvbridgeError) as info:
            await call(secure.registry.RegisterEngine, registry_pb2.RegisterEngineRequest(engine=rogue), key)
        assert info.value.reason == Reason.TENANT_FORBIDDEN.value
        # ... nor replace or remove a real one.
        impostor = types_pb2.Engine()
        impostor.CopyFrom(rogue)
        impostor.engine_id = "d0"
        with pytest.raises(KvbridgeError) as info:
            await call(secure.registry.RegisterEngine, registry_pb2.RegisterEngineRequest(engine=impostor), key)
        assert info.value.reason == Reason.TENANT_FORBIDDEN.value
        with pytest.raises(KvbridgeError) as info:
            await call(secure.registry.DeregisterEngine, registry_pb2.DeregisterEngineRequest(engine_id="d0"), key)
        assert info.value.reason == Reason.TENANT_FORBIDDEN.value
    assert set(secure.registry_app.index.engines) == engines_before
    assert canary.connections == 0


async def test_entry_naming_an_unknown_engine_is_refused(secure: SecureStack) -> None:
    """An entry must point at a registered engine: a location cannot be invented by whoever registers."""
    tokens = list(range(30, 30 + 4 * BLOCK))
    lease_id = await secure.entry_lease("acme", "c-rogue")
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key="c-rogue"),
        engine_id="rogue",
        engine_request_id="r",
        block_ids=[types_pb2.BlockIds(ids=[1, 2, 3, 4])],
        block_size=BLOCK,
        token_count=4 * BLOCK,
        block_hashes=chain(tokens, "acme"),
        lease_id=lease_id,
        epoch=1,
    )
    for key in (ACME_KEY, GLOBEX_KEY):
        with pytest.raises(KvbridgeError) as info:
            await call(
                secure.registry.RegisterEntry,
                registry_pb2.RegisterEntryRequest(request_id=f"rq-{key}", entry=entry),
                key,
            )
        assert info.value.code.name in {"NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARGUMENT", "FAILED_PRECONDITION"}, (
            info.value
        )
    assert ("acme", MODEL, "c-rogue") not in secure.registry_app.index.entries


async def test_gateway_uses_registry_host_not_client_host(secure: SecureStack, canary: Canary) -> None:
    """A reused turn's P request carries D's host/port from the registry's engine record, never the client's."""
    msgs = [{"role": "user", "content": LONG}]
    async with secure.http(ACME_KEY) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": msgs, "max_tokens": 4, "conversation_id": "c-ssrf"},
        )
        await secure.settle()
        follow = [
            *msgs,
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "next"},
        ]
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": follow,
                "max_tokens": 4,
                "conversation_id": "c-ssrf",
                "kv_transfer_params": _forged(canary.port),
            },
        )
        assert r.status_code == 200 and r.headers["x-kvbridge-reuse"].startswith("hit;")
    sent = secure.prefill.engine.stats.last_kv_transfer_params
    assert sent is not None and sent["remote_host"] == "127.0.0.1" and sent["remote_port"] == secure.decode.cfg.port
    assert canary.connections == 0


async def test_kvbridge_fields_sent_straight_to_an_engine_are_ignored(secure: SecureStack) -> None:
    """D's connector trusts kvbridge_* fields only with the gateway's signature under the deployment secret: the
    fields the gateway sent D verify (and name the caller's tenant); the same fields, forged (another tenant, an
    epoch of 2^63-1 that would block the conversation's future registrations) and posted straight to D, do not."""
    from kvbridge_connector import params as cparams

    async with secure.http(ACME_KEY) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 4,
                "conversation_id": "c-signed",
            },
        )
        assert r.status_code == 200, r.text
    via_gateway = [p for p in secure.decode.engine.stats.kv_transfer_params_seen if p and cparams.TENANT in p]
    assert via_gateway, "the gateway sent D no kvbridge fields"
    ref = cparams.parse_conversation(via_gateway[-1], MODEL, SECRET)
    assert ref is not None and (ref.tenant, ref.conversation_key) == ("acme", "c-signed")

    forged_fields = [
        {**via_gateway[-1], cparams.EPOCH: 2**63 - 1},  # the gateway's signature, another epoch
        {**via_gateway[-1], cparams.TENANT: "globex"},  # ... another tenant
        {k: v for k, v in via_gateway[-1].items() if k not in ("kvbridge_signature", "kvbridge_issued_at")},
    ]
    async with httpx.AsyncClient(base_url=secure.decode.url, timeout=30) as engine:
        for forged in forged_fields:
            r = await engine.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "hello there", "max_tokens": 2, "kv_transfer_params": forged},
            )
            assert r.status_code == 200, r.text
            seen = secure.decode.engine.stats.kv_transfer_params_seen[-1]
            assert seen is not None and seen.get(cparams.EPOCH) == forged.get(cparams.EPOCH)  # what D's connector sees
            assert cparams.parse_conversation(seen, MODEL, SECRET) is None
