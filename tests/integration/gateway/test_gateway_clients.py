"""Stock clients against the gateway: the OpenAI Python SDK and the gRPC GatewayService."""

from __future__ import annotations

import grpc
import openai
from openai.types.chat import ChatCompletionMessageParam

from kvbridge.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.fixtures.gateway_stack import LONG, reference

from .conftest import MODEL, Stack


async def test_openai_sdk_non_streaming_and_streaming(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key="key-acme")
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        extra_body={"conversation_id": "sdk-1"},
    )
    text = resp.choices[0].message.content
    assert text == await reference(stack, msgs, max_tokens=6)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await stack.settle()
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        stream=True,
        extra_headers={"X-Session-ID": "sdk-1"},
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == await reference(stack, msgs)
    completion = await client.completions.create(model=MODEL, prompt=list(range(10, 90)), max_tokens=4)
    assert completion.choices[0].text.strip().startswith("w")
    await client.close()


async def test_grpc_gateway_streams_with_reuse_report(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        md = (("authorization", "Bearer key-acme"),)
        req = gateway_pb2.CreateChatCompletionRequest(
            model=MODEL,
            conversation_id="g-1",
            messages=[gateway_pb2.ChatMessage(role="user", content=LONG)],
            sampling=gateway_pb2.SamplingParams(max_tokens=5),
        )
        msgs = [m async for m in stub.CreateChatCompletion(req, metadata=md)]
        assert msgs[0].reuse.verdict == "miss"
        text = "".join(m.delta_content for m in msgs)
        assert text == await reference(stack, [{"role": "user", "content": LONG}], max_tokens=5)
        assert sum(len(m.delta_token_ids) for m in msgs) == 5
        assert msgs[-1].usage.completion_tokens == 5
        models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=md)
        assert models.models[0].id == MODEL and models.models[0].decode_engines == 1
        try:
            await stub.ListModels(gateway_pb2.ListModelsRequest())
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            raise AssertionError("unauthenticated call succeeded")
