"""The SDK against a live stack: gateway + registry + lease manager (all checking the same API keys,
entry leases with a short TTL) + simulated P/D engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fixtures.gateway_stack import Stack, running_stack

# Short, so a test can wait past it; the SDK's heartbeats (every TTL/3 at most) must keep leases alive.
ENTRY_LEASE_TTL_S = 1.5
ACME_KEY = "key-acme"


@pytest.fixture
async def sdk_stack() -> AsyncIterator[Stack]:
    async with running_stack(secure_control_plane=True, entry_lease_ttl_s=ENTRY_LEASE_TTL_S) as s:
        yield s
