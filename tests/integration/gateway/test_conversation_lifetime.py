"""Conversation lifetime at the gateway: per-turn renewals over one long-lived KeepAlive stream, and closing."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.errors import NotFound
from kvbridge.sdk import ClientOptions, GatewayClient, LeaseClient, RegistryClient
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.gateway.control import ControlPlaneError
from kvbridge_services.gateway.renewer import ConversationRenewer
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from tests.fixtures.gateway_stack import LONG, MODEL, running_stack, turn

TTL_S = 1.5


async def test_touches_keep_a_conversation_lease_alive_over_one_stream() -> None:
    async with running_stack(entry_lease_ttl_s=TTL_S) as stack:
        assert stack.registry is not None and stack.lease is not None
        await turn(stack, [{"role": "user", "content": LONG}], conv="renewed")
        await turn(stack, [{"role": "user", "content": LONG}], conv="idle")
        async with RegistryClient(stack.registry.address) as reg, LeaseClient(stack.lease.address) as leases:
            renewed = (await reg.get_entry("acme", MODEL, "renewed")).lease_id
            idle = (await reg.get_entry("acme", MODEL, "idle")).lease_id
            renewer = ConversationRenewer(stack.gateway.core.control)
            try:
                for _ in range(int(3 * TTL_S / 0.3)):  # three TTLs, a touch every 0.3 s
                    renewer.touch("acme", MODEL, "renewed")
                    await asyncio.sleep(0.3)
                await renewer.flush()
                assert (await leases.get(renewed)).lease_id == renewed
                with pytest.raises(NotFound):
                    await leases.get(idle)  # nobody renewed it: expired after its TTL
                # Touches 0.3 s apart are written at most MAX_DELAY_S (0.5 s) after the first pending one.
                assert renewer.streams_opened == 1 and renewer.sent >= 5
            finally:
                await renewer.stop()
            await asyncio.sleep(2 * TTL_S)
            with pytest.raises(NotFound):
                await leases.get(renewed)  # renewals stopped: the lease ends like any other


async def test_a_touch_is_written_when_the_turn_ends_or_within_the_maximum_delay() -> None:
    async with running_stack() as stack:
        patient = ConversationRenewer(stack.gateway.core.control, max_delay_s=30.0)
        prompt = ConversationRenewer(stack.gateway.core.control, max_delay_s=0.3)
        try:
            patient.touch("acme", MODEL, "c1")
            prompt.touch("acme", MODEL, "c1")
            await asyncio.sleep(0.1)
            assert patient.sent == 0 and prompt.sent == 0  # not mid-turn
            patient.flush_soon()  # the turn ended
            async with asyncio.timeout(5):
                while patient.sent < 1 or prompt.sent < 1:  # noqa: ASYNC110 - polling the renewers
                    await asyncio.sleep(0.02)
            assert prompt.sent == 1  # a long turn: written once the maximum delay passed
        finally:
            await patient.stop()
            await prompt.stop()


async def test_the_renewer_reopens_its_stream_after_the_lease_manager_restarts() -> None:
    async with running_stack() as stack:
        assert stack.lease is not None
        renewer = ConversationRenewer(stack.gateway.core.control)
        try:
            renewer.touch("acme", MODEL, "c1")
            await renewer.flush()
            assert renewer.streams_opened == 1
            port = int(stack.lease.address.rsplit(":", 1)[1])
            await stack.lease.stop()
            renewer.touch("acme", MODEL, "c1")  # written into a dead stream or refused: best effort
            await asyncio.sleep(0.5)
            restarted = LeaseApp(
                stack.lease.store,
                LeasePolicy(port=port, leader_ttl_s=2, leader_refresh_s=0.5),
                ServerSettings(shutdown_grace_s=0.2),
            )
            await restarted.start()
            try:
                async with asyncio.timeout(20):
                    while renewer.streams_opened < 2 or renewer.sent < 3:
                        renewer.touch("acme", MODEL, "c1")
                        await asyncio.sleep(0.2)
            finally:
                await restarted.stop()
        finally:
            await renewer.stop()


async def test_closing_right_after_a_turn_also_releases_what_that_turn_is_registering() -> None:
    async with running_stack() as stack:
        assert stack.registry is not None
        control = stack.gateway.core.control
        grant = control.grant_lease

        async def slow_grant(**kwargs: object) -> int:
            await asyncio.sleep(0.5)  # the turn's background registration is still running at close time
            return await grant(**kwargs)  # type: ignore[arg-type]

        control.grant_lease = slow_grant  # type: ignore[method-assign]
        r = await stack.client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 8,
                "conversation_id": "closing",
            },
        )
        assert r.status_code == 200, r.text
        async with GatewayClient(stack.gateway.grpc_address, ClientOptions(api_key="key-acme")) as gw:
            assert await gw.close_conversation(model=MODEL, conversation_id="closing")
        await stack.settle()
        async with RegistryClient(stack.registry.address) as reg:
            with pytest.raises(NotFound):
                await reg.get_entry("acme", MODEL, "closing")


async def test_a_node_lease_renewal_with_the_lease_manager_gone_is_a_control_plane_error() -> None:
    async with running_stack() as stack:
        assert stack.lease is not None
        control = stack.gateway.core.control
        assert await control.keep_alive(lease_ids=[1])  # reachable: one status per id
        await stack.lease.stop()
        # Whatever the race between the request and the stream's end, the failure is the RPC's status
        # (a ControlPlaneError), never grpc's InvalidStateError, which once escaped the gateway's stop().
        for _ in range(20):
            with pytest.raises(ControlPlaneError):
                await control.keep_alive(lease_ids=[1])
        await stack.gateway.core.stop()  # the node-lease loop's failures do not escape the shutdown
