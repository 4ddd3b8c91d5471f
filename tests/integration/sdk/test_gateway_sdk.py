"""The async SDK against a live stack through real gRPC: chat, streaming, reuse, conversations, errors.

The simulated engines are stock-vLLM-like (no connector on D), so the gateway registers a turn's KV
itself ("compatibility mode") and only for non-streamed HTTP turns; the gRPC API always streams. Turns
whose KV a test needs registered are therefore seeded over HTTP with ``turn()``, and the SDK continues
the conversation (as it would after a connector-registered turn in production).
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvbridge.errors import InvalidArgument, NotFound, Reason, Unauthenticated
from kvbridge.sdk import ClientOptions, GatewayClient, LeaseClient, RegistryClient, Sampling
from tests.fixtures.gateway_stack import LONG, MODEL, OPERATOR_KEY, Stack, reference, turn

from .conftest import ACME_KEY, ENTRY_LEASE_TTL_S

ACME = ClientOptions(api_key=ACME_KEY)
OPERATOR = ClientOptions(api_key=OPERATOR_KEY)  # inspects entries and leases (tenants may not)
KEEPALIVE = "/kvbridge.lease.v1.LeaseService/KeepAlive"


def _sample_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sum(
        s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def keepalive_streams_ended(stack: Stack) -> float:
    assert stack.lease is not None
    return _sample_sum(stack.lease.telemetry.registry, "kvbridge_grpc_server_handled_total", method=KEEPALIVE)


def renewals(stack: Stack) -> float:
    assert stack.lease is not None
    return _sample_sum(stack.lease.telemetry.registry, "kvbridge_lease_renewals_total")


async def test_chat_stream_complete_and_reuse_report(sdk_stack: Stack) -> None:
    async with GatewayClient(sdk_stack.gateway.grpc_address, ACME) as gw:
        assert [(m.id, m.decode_engines) for m in await gw.list_models()] == [(MODEL, 1)]
        msgs: list[dict[str, str]] = [{"role": "user", "content": LONG}]
        first = await gw.chat(msgs, model=MODEL, conversation_id="sdk-c0", sampling=Sampling(max_tokens=6))
        assert first.reuse.verdict == "miss" and first.reuse.prompt_tokens > 100
        assert first.text == await reference(sdk_stack, msgs, max_tokens=6)
        assert len(first.token_ids) == 6 and first.usage.completion_tokens == 6 and first.finish_reason

        # Turn 1 registered (see the module docstring), turn 2 streamed through the SDK reuses its KV.
        answer, _ = await turn(sdk_stack, msgs, "sdk-c1")
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        chunks = [
            c
            async for c in gw.stream_chat(msgs, model=MODEL, conversation_id="sdk-c1", sampling=Sampling(max_tokens=8))
        ]
        assert len(chunks) > 1  # streamed, not one collected message
        assert chunks[0].reuse.verdict == "hit"
        assert chunks[0].reuse.verified_tokens >= 64 and chunks[0].reuse.pulled_tokens > 0
        assert "".join(c.delta_content for c in chunks) == await reference(sdk_stack, msgs)

        done = await gw.complete(list(range(10, 90)), model=MODEL, sampling=Sampling(max_tokens=4))
        assert done.text.strip().startswith("w") and len(done.token_ids) == 4
        streamed = [
            c.delta_text async for c in gw.stream_complete("w10 w11 w12", model=MODEL, sampling=Sampling(max_tokens=3))
        ]
        assert "".join(streamed).strip()


async def test_bad_input_and_credentials_raise_typed_errors(sdk_stack: Stack) -> None:
    address = sdk_stack.gateway.grpc_address
    async with GatewayClient(address, ACME) as gw:
        with pytest.raises(InvalidArgument) as bad:
            await gw.chat([], model=MODEL)
        assert bad.value.reason == Reason.INVALID_FIELD and bad.value.metadata.get("field") == "messages"
        with pytest.raises(InvalidArgument) as bad_key:
            await gw.close_conversation(model=MODEL, conversation_id="tab\tin key")
        assert bad_key.value.reason == Reason.INVALID_FIELD
        with pytest.raises(NotFound) as no_model:  # raised from the stream, typed the same way
            async for _ in gw.stream_chat([{"role": "user", "content": "hi"}], model="no-such-model"):
                pass
        assert no_model.value.reason == Reason.MODEL_NOT_FOUND
    async with GatewayClient(address) as anonymous:
        with pytest.raises(Unauthenticated) as unauth:
            await anonymous.list_models()
        assert unauth.value.reason == Reason.UNAUTHENTICATED


async def _seeded(stack: Stack, key: str, content: str = LONG) -> list[dict[str, str]]:
    """A registered first turn of conversation ``key`` (under a lease with the short TTL); its history."""
    msgs = [{"role": "user", "content": content}]
    answer, verdict = await turn(stack, msgs, key, max_tokens=6)
    assert verdict.startswith("miss")
    return [*msgs, {"role": "assistant", "content": answer}]


async def test_conversation_outlives_lease_ttl_and_close_releases_kv(sdk_stack: Stack) -> None:
    assert sdk_stack.lease is not None and sdk_stack.registry is not None
    registry = RegistryClient(sdk_stack.registry.address, OPERATOR)
    leases = LeaseClient(sdk_stack.lease.address, OPERATOR)
    history = await _seeded(sdk_stack, "agent-1")
    lease_id = (await registry.get_entry("acme", MODEL, "agent-1")).lease_id
    async with GatewayClient(
        sdk_stack.gateway.grpc_address,
        ACME,
        lease_target=sdk_stack.lease.address,
        heartbeat_interval_s=ENTRY_LEASE_TTL_S / 4,
    ) as gw:
        async with gw.conversation(
            model=MODEL, key="agent-1", history=history, sampling=Sampling(max_tokens=6)
        ) as conv:
            # The agent "runs tools" for well over the TTL: only the heartbeats keep the KV.
            await asyncio.sleep(ENTRY_LEASE_TTL_S * 3)
            assert (await leases.get(lease_id)).lease_id == lease_id
            assert (await registry.get_entry("acme", MODEL, "agent-1")).lease_id == lease_id
            reply = await conv.send("now summarize")
            assert reply.reuse.verdict == "hit"
            assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
            assert conv.messages[-1]["content"] == reply.text
            await sdk_stack.settle()
        assert conv.closed
        # A conversation that still holds KV when closed releases it at once, not at the end of a TTL.
        history = await _seeded(sdk_stack, "agent-2")
        lease_id = (await registry.get_entry("acme", MODEL, "agent-2")).lease_id
        conv = gw.conversation(model=MODEL, key="agent-2", history=history)
        conv.open()
        assert await conv.close() is True
        with pytest.raises(NotFound) as no_entry:
            await registry.get_entry("acme", MODEL, "agent-2")
        assert no_entry.value.reason == Reason.ENTRY_NOT_FOUND
        with pytest.raises(NotFound) as no_lease:
            await leases.get(lease_id)
        assert no_lease.value.reason == Reason.LEASE_NOT_FOUND
        assert await conv.close() is False  # idempotent
    await registry.close()
    await leases.close()


async def test_lease_expires_without_the_conversation_handle(sdk_stack: Stack) -> None:
    """The control for the test above: without heartbeats the same lease is gone after the TTL."""
    assert sdk_stack.lease is not None and sdk_stack.registry is not None
    await _seeded(sdk_stack, "no-agent")
    async with RegistryClient(sdk_stack.registry.address, OPERATOR) as registry:
        lease_id = (await registry.get_entry("acme", MODEL, "no-agent")).lease_id
        await asyncio.sleep(ENTRY_LEASE_TTL_S * 3)
        async with LeaseClient(sdk_stack.lease.address, OPERATOR) as leases:
            with pytest.raises(NotFound):
                await leases.get(lease_id)


async def test_two_conversations_share_one_keepalive_stream(sdk_stack: Stack) -> None:
    assert sdk_stack.lease is not None and sdk_stack.registry is not None
    registry = RegistryClient(sdk_stack.registry.address, OPERATOR)
    h1 = await _seeded(sdk_stack, "pair-1")
    h2 = await _seeded(sdk_stack, "pair-2", LONG + " and more")
    async with GatewayClient(
        sdk_stack.gateway.grpc_address,
        ACME,
        lease_target=sdk_stack.lease.address,
        heartbeat_interval_s=ENTRY_LEASE_TTL_S / 4,
    ) as gw:
        a = gw.conversation(model=MODEL, key="pair-1", history=h1)
        b = gw.conversation(model=MODEL, key="pair-2", history=h2)
        ended_before, renewed_before = keepalive_streams_ended(sdk_stack), renewals(sdk_stack)
        async with a, b:
            await asyncio.sleep(ENTRY_LEASE_TTL_S * 3)
            for conv in (a, b):  # both kept alive well past the TTL ...
                await registry.get_entry("acme", MODEL, conv.key)
            # ... by renewals on a stream that is still open: no KeepAlive stream ended meanwhile.
            assert renewals(sdk_stack) >= renewed_before + 2 * 3
            assert keepalive_streams_ended(sdk_stack) == ended_before
            leases = gw.conversation_leases
            assert leases is not None and leases.heartbeater is not None
            assert leases.open_conversations == 2 and leases.heartbeater.streams_opened == 1
        # Both closed: the one shared stream ended (exactly one more KeepAlive stream handled).
        await asyncio.sleep(0.2)
        assert keepalive_streams_ended(sdk_stack) == ended_before + 1
        assert not leases.heartbeater.running
    await registry.close()
