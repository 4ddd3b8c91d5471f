"""DeleteEntry with expected_epoch: the atomic consume the gateway uses for single-use (compatibility-mode)
entries. Of several callers that saw one entry, exactly one deletes it; a newer entry is never deleted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbridge.errors import Reason, from_rpc_error
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2

from .conftest import MODEL, Env

KEY = registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key="c1")
TOKENS = list(range(10, 74))


async def consume(env: Env, epoch: int) -> registry_pb2.DeleteEntryResponse:
    resp: registry_pb2.DeleteEntryResponse = await env.stub.DeleteEntry(
        registry_pb2.DeleteEntryRequest(key=KEY, reason=types_pb2.REVOKE_REASON_EXPIRED, expected_epoch=epoch)
    )
    return resp


async def test_of_concurrent_consumers_exactly_one_takes_the_entry(env: Env) -> None:
    await env.engine()
    await env.register(TOKENS, epoch=5)
    results = await asyncio.gather(*(consume(env, 5) for _ in range(8)), return_exceptions=True)
    taken = [r for r in results if isinstance(r, registry_pb2.DeleteEntryResponse)]
    assert len(taken) == 1 and taken[0].entry.epoch == 5
    codes = {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}
    assert codes <= {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION} and len(results) == 8


async def test_a_newer_entry_is_not_deleted_by_a_stale_consume(env: Env) -> None:
    await env.engine()
    await env.register(TOKENS, epoch=5)
    await env.register(TOKENS + [99] * 16, epoch=6)  # the next turn's state replaced it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await consume(env, 5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert from_rpc_error(err.value).reason == Reason.STALE_EPOCH
    stored = await env.stub.GetEntry(registry_pb2.GetEntryRequest(key=KEY))
    assert stored.entry.epoch == 6
    taken = await consume(env, 6)
    assert taken.entry.epoch == 6
