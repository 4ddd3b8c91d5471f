"""Gateway + real registry + real lease manager + engine simulators (built in tests/fixtures/gateway_stack.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fixtures.gateway_stack import BLOCK, KEYS, MODEL, SECRET_HEX, Stack, running_stack

__all__ = ["BLOCK", "KEYS", "MODEL", "SECRET_HEX", "Stack", "stack"]


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        yield s
