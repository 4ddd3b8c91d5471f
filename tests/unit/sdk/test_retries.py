"""Retry, backoff and error-typing rules of the SDK's calls, against a scripted server over real gRPC."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.errors import InvalidArgument, NotFound, Reason, Unavailable, invalid_field
from kvbridge.sdk import ClientOptions, GatewayClient, Sampling
from kvbridge.sdk.channel import TENANT_METADATA_KEY, backoff_delays

from .conftest import ScriptedGateway, Served, Step, serve

FAST = ClientOptions(max_attempts=4, backoff_initial_s=0.001, backoff_max_s=0.004)
DOWN = Unavailable(Reason.STORE_UNAVAILABLE, "try again")


def test_backoff_grows_jittered_and_capped() -> None:
    opts = ClientOptions(max_attempts=8, backoff_initial_s=0.1, backoff_max_s=1.0)
    for _ in range(50):
        delays = list(backoff_delays(opts))
        assert len(delays) == 7  # one sleep between each pair of attempts
        nominal = [min(0.1 * 2**i, 1.0) for i in range(7)]
        for got, want in zip(delays, nominal, strict=True):
            assert want * 0.5 <= got <= min(want * 1.5, 1.0)
    assert list(backoff_delays(ClientOptions(max_attempts=1))) == []


async def test_unary_unavailable_is_retried_then_succeeds(scripted: Served) -> None:
    scripted.servicer.script = [Step(error=DOWN), Step(error=DOWN)]
    async with GatewayClient(scripted.address, FAST) as gw:
        assert [m.id for m in await gw.list_models()] == ["m"]
    assert scripted.servicer.calls == ["ListModels"] * 3


async def test_unary_gives_up_after_max_attempts_with_the_typed_error(scripted: Served) -> None:
    scripted.servicer.script = [Step(error=DOWN)] * 10
    async with GatewayClient(scripted.address, FAST) as gw:
        with pytest.raises(Unavailable) as exc:
            await gw.list_models()
    assert exc.value.reason == Reason.STORE_UNAVAILABLE
    assert len(scripted.servicer.calls) == FAST.max_attempts


async def test_other_errors_are_not_retried(scripted: Served) -> None:
    scripted.servicer.script = [Step(error=invalid_field("model", "bad"))]
    async with GatewayClient(scripted.address, FAST) as gw:
        with pytest.raises(InvalidArgument) as exc:
            await gw.list_models()
    assert exc.value.reason == Reason.INVALID_FIELD and exc.value.metadata == {"field": "model"}
    assert scripted.servicer.calls == ["ListModels"]


async def test_stream_is_retried_only_before_its_first_chunk(scripted: Served) -> None:
    scripted.servicer.script = [Step(chunks=0, error=DOWN), Step(chunks=3)]
    async with GatewayClient(scripted.address, FAST) as gw:
        result = await gw.chat([{"role": "user", "content": "hi"}], model="m")
        assert result.text == "t0 t1 t2 " and result.token_ids == [0, 1, 2]
        assert scripted.servicer.calls == ["CreateChatCompletion"] * 2

        scripted.servicer.script = [Step(chunks=2, error=DOWN), Step(chunks=3)]
        seen: list[str] = []
        with pytest.raises(Unavailable) as exc:
            async for chunk in gw.stream_chat([{"role": "user", "content": "hi"}], model="m"):
                seen.append(chunk.delta_content)
        # The error surfaces after the chunks already delivered; no second generation was started.
        assert seen == ["t0 ", "t1 "] and exc.value.reason == Reason.STORE_UNAVAILABLE
        assert scripted.servicer.calls == ["CreateChatCompletion"] * 3


async def test_stream_errors_are_typed_from_error_info(scripted: Served) -> None:
    scripted.servicer.script = [Step(chunks=0, error=NotFound(Reason.MODEL_NOT_FOUND, "no model x"))]
    async with GatewayClient(scripted.address, FAST) as gw:
        with pytest.raises(NotFound) as exc:
            await gw.chat([{"role": "user", "content": "hi"}], model="x", sampling=Sampling(max_tokens=3))
    assert exc.value.reason == Reason.MODEL_NOT_FOUND and "no model x" in exc.value.message
    assert scripted.servicer.calls == ["CreateChatCompletion"]


async def test_closing_a_stream_early_cancels_the_call(scripted: Served) -> None:
    scripted.servicer.script = [Step(chunks=100, pause_s=0.01)]
    async with GatewayClient(scripted.address, FAST) as gw:
        stream = gw.stream_chat([{"role": "user", "content": "hi"}], model="m")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if scripted.servicer.cancelled:
                break
            await asyncio.sleep(0.01)
    assert scripted.servicer.cancelled == 1


async def test_not_leader_redirects_to_the_named_leader() -> None:
    leader = ScriptedGateway()
    leader_server, leader_address = await serve(leader)
    follower = ScriptedGateway(
        script=[Step(error=Unavailable(Reason.NOT_LEADER, "not me", metadata={"leader": leader_address}))]
    )
    follower_server, follower_address = await serve(follower)
    try:
        async with GatewayClient(follower_address, FAST) as gw:
            assert [m.id for m in await gw.list_models()] == ["m"]
            assert gw.target == leader_address
        assert follower.calls == ["ListModels"] and leader.calls == ["ListModels"]
    finally:
        await leader_server.stop(0)
        await follower_server.stop(0)


async def test_credentials_and_tenant_travel_as_metadata(scripted: Served) -> None:
    async with GatewayClient(scripted.address, ClientOptions(api_key="k1", tenant="acme")) as gw:
        await gw.list_models()
        await gw.chat([{"role": "user", "content": "hi"}], model="m")
    for md in scripted.servicer.metadata:
        assert md["authorization"] == "Bearer k1" and md[TENANT_METADATA_KEY] == "acme"
