"""NOT_LEADER redirects and the way back: when the leader a redirect named dies, the client and the
Heartbeater return to the configured target and follow the next redirect from there (real loopback gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from kvbridge.errors import DeadlineExceeded, Reason, Unavailable
from kvbridge.sdk import ClientOptions, GatewayClient, Heartbeater, LeaseClient

from .conftest import ScriptedGateway, ScriptedLease, Step, serve, serve_lease

OPTS = ClientOptions(max_attempts=5, backoff_initial_s=0.001, backoff_max_s=0.004, timeout_s=2.0)


def _not_leader(leader: str) -> Unavailable:
    return Unavailable(Reason.NOT_LEADER, "not me", metadata={"leader": leader})


async def test_client_falls_back_to_the_configured_target_when_the_redirected_leader_dies() -> None:
    old_leader, new_leader = ScriptedGateway(), ScriptedGateway()
    old_server, old_address = await serve(old_leader)
    new_server, new_address = await serve(new_leader)
    # The configured target (a Service in a deployment): first redirects to the old leader; after it died,
    # still names it once (its leader key not yet expired), then names the new leader.
    configured = ScriptedGateway(
        script=[
            Step(error=_not_leader(old_address)),
            Step(error=_not_leader(old_address)),
            Step(error=_not_leader(new_address)),
        ]
    )
    configured_server, configured_address = await serve(configured)
    try:
        async with GatewayClient(configured_address, OPTS) as gw:
            await gw.list_models()
            assert gw.target == old_address and old_leader.calls == ["ListModels"]
            await old_server.stop(0)  # the leader dies

            assert [m.id for m in await gw.list_models()] == ["m"]
            assert gw.target == new_address and gw.configured_target == configured_address
        # The stale redirect to the dead address was not followed again: configured, configured, new leader.
        assert old_leader.calls == ["ListModels"]
        assert configured.calls == ["ListModels"] * 3 and new_leader.calls == ["ListModels"]
    finally:
        for server in (old_server, new_server, configured_server):
            await server.stop(0)


async def test_an_answered_unavailable_from_the_leader_keeps_the_client_there() -> None:
    leader = ScriptedGateway(script=[Step(error=Unavailable(Reason.STORE_UNAVAILABLE, "etcd hiccup"))])
    leader_server, leader_address = await serve(leader)
    configured = ScriptedGateway(script=[Step(error=_not_leader(leader_address))])
    configured_server, configured_address = await serve(configured)
    try:
        async with GatewayClient(configured_address, OPTS) as gw:
            await gw.list_models()
            assert gw.target == leader_address
        # The leader answered (the store failed, not the leader): retried there, no detour via the configured one.
        assert configured.calls == ["ListModels"] and leader.calls == ["ListModels"] * 2
    finally:
        await leader_server.stop(0)
        await configured_server.stop(0)


async def _until(predicate: Callable[[], bool], bound_s: float = 20.0) -> None:
    for _ in range(int(bound_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached within {bound_s}s")


@contextlib.asynccontextmanager
async def _heartbeating(target: str) -> AsyncIterator[tuple[LeaseClient, Heartbeater]]:
    """A client of ``target`` and its Heartbeater renewing lease 7 every 50 ms."""
    client = LeaseClient(target, OPTS)
    beat = Heartbeater(client, interval_s=0.05)
    beat.add_lease(7)
    beat.start()
    try:
        yield client, beat
    finally:
        await beat.stop()
        await client.close()


async def test_heartbeater_follows_not_leader_on_its_stream_and_falls_back_when_the_leader_dies() -> None:
    leader = ScriptedLease()
    leader_server, leader_address = await serve_lease(leader)
    configured = ScriptedLease(script=[_not_leader(leader_address)])  # then renews itself (took over)
    configured_server, configured_address = await serve_lease(configured)
    try:
        async with _heartbeating(configured_address) as (client, beat):
            await _until(lambda: leader.renewals >= 2)
            assert client.target == leader_address  # the stream reconnected to the leader its NOT_LEADER named
            assert configured.streams == 1 and configured.renewals == 0

            await leader_server.stop(0)  # the leader dies under the open stream
            await _until(lambda: configured.renewals >= 2)
            assert client.target == configured_address
            assert beat.streams_opened >= 3
    finally:
        await leader_server.stop(0)
        await configured_server.stop(0)


async def test_heartbeater_survives_the_client_moving_its_channel_under_the_stream() -> None:
    first, second = ScriptedLease(), ScriptedLease()
    first_server, first_address = await serve_lease(first)
    second_server, second_address = await serve_lease(second)
    try:
        async with _heartbeating(first_address) as (client, beat):
            await _until(lambda: first.renewals >= 2)
            client._redirect(second_address)  # as a unary call's NOT_LEADER would: the old channel is closed
            await _until(lambda: second.renewals >= 2)  # the stream cut by that close was re-opened, not given up
            assert beat._task is not None and not beat._task.done()
    finally:
        await first_server.stop(0)
        await second_server.stop(0)


async def test_after_a_deadline_on_the_redirected_address_the_next_call_starts_from_the_configured_one() -> None:
    # A leader that accepts connections but never answers (a hung host): every attempt there runs into its deadline.
    silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    silent_address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    configured = ScriptedGateway(script=[Step(error=_not_leader(silent_address))])
    configured_server, configured_address = await serve(configured)
    try:
        async with GatewayClient(configured_address, ClientOptions(timeout_s=0.3, backoff_initial_s=0.001)) as gw:
            with pytest.raises(DeadlineExceeded):  # deadlines are not retried (the call may have taken effect)
                await gw.list_models()
            assert gw.target == configured_address  # but the client no longer points at the silent address
            await gw.list_models()
        assert configured.calls == ["ListModels"] * 2
    finally:
        silent.close()
        await configured_server.stop(0)
