"""Close means closed (issue 30): in connector mode D's connector registers a turn's entry on its own schedule, so
a CloseConversation right after the turn can come before that registration. The registry leaves a close tombstone
at the close's time; the registration of the turn (an older epoch) is refused when it lands, D frees its blocks,
and the conversation's next turn does not reuse it. Before: the entry registered after the close lived for its
lease and kept serving hits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvbridge.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvbridge_services.common.keys import KeyLayout

from .connector_stack import LONG, MODEL, ConnectorStack

pytestmark = [pytest.mark.slow]
REGISTRATION_DELAY_S = 0.5


async def test_a_close_right_after_a_turn_wins_over_its_registration(tmp_path: Path) -> None:
    stack = ConnectorStack(tmp_path / "data")
    await stack.start_services()
    try:
        await stack.start_engines()
        plane = stack.d_connector().plane
        msgs = [{"role": "user", "content": LONG}]
        answer, verdict = await stack.turn(msgs, "c1")
        await stack.wait_registered(1)
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]

        # D's registrations now land REGISTRATION_DELAY_S after the turn (a busy registry or connector thread).
        register = plane._register_entry

        async def late(command: Any) -> None:
            await asyncio.sleep(REGISTRATION_DELAY_S)
            await register(command)

        plane._register_entry = late
        answer, verdict = await stack.turn(msgs, "c1")
        assert verdict.startswith("hit"), verdict
        assert stack.services is not None and stack.services.gateway is not None
        async with grpc.aio.insecure_channel(stack.services.gateway.grpc_address) as channel:
            closed = await gateway_pb2_grpc.GatewayServiceStub(channel).CloseConversation(
                gateway_pb2.CloseConversationRequest(model=MODEL, conversation_id="c1"),
                metadata=(("authorization", "Bearer key-acme"),),
                timeout=10,
            )
        print(f"close right after the turn: released={closed.released}")
        plane._register_entry = register
        await asyncio.sleep(REGISTRATION_DELAY_S + 1.0)  # the turn's registration has landed (or been refused)
        stack.decode.engine.sync_connector()
        assert stack.store is not None  # refused: no entry for the conversation
        assert await stack.store.get(KeyLayout().entry("acme", MODEL, "c1")) is None
        registered = stack.d_connector().registered

        # Released when it landed: D frees the turn's blocks (after the grace), and nothing is offered.
        await stack.wait_held(0)
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "after the close"}]
        answer, verdict = await stack.turn(msgs, "c1")
        print(f"the turn after the close: {verdict}")
        assert not verdict.startswith("hit"), verdict
        assert answer == await stack.reference(msgs)
        assert await stack.unsafe_reads() == 0

        # The tombstone refuses only what began before the close: the conversation goes on reusing.
        await stack.wait_registered(registered + 1)
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "and again"}]
        answer, verdict = await stack.turn(msgs, "c1")
        assert verdict.startswith("hit"), verdict
        assert answer == await stack.reference(msgs)
    finally:
        await stack.stop_services()
        await stack.stop_engines()
