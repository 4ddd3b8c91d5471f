"""Start lease managers for tests: in-process on a real store, real gRPC over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc

from kvbridge.lease.v1 import lease_pb2_grpc
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.base import Store
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy


async def wait_until(predicate: Any, timeout_s: float = 10.0, step_s: float = 0.02) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state owned by another task
            await asyncio.sleep(step_s)


@asynccontextmanager
async def lease_app(
    store: Store, **policy: Any
) -> AsyncIterator[tuple[LeaseApp, lease_pb2_grpc.LeaseServiceAsyncStub]]:
    settings = {"port": 0, "leader_ttl_s": 2, "leader_refresh_s": 0.5, **policy}
    app = LeaseApp(store, LeasePolicy(**settings), ServerSettings(shutdown_grace_s=0.5))
    await app.start()
    channel = grpc.aio.insecure_channel(app.address)
    try:
        await wait_until(lambda: app.is_leader)
        yield app, lease_pb2_grpc.LeaseServiceStub(channel)
    finally:
        await channel.close()
        await app.stop(0.2)
