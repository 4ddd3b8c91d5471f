"""The one in-process stack builder (kvbridge_services.stack.ServiceStack): a start that fails or is cancelled
halfway stops everything it had started (ports released, no task left), in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack

SECRET_HEX = "00112233445566778899aabbccddeeff"


def _services(
    store: MemoryStore, gateway: GatewaySettings | None = None, *, leader_timeout_s: float = 10.0
) -> ServiceStack:
    return ServiceStack(
        store,
        lease_policy=LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
        registry=RegistrySettings(port=0),
        gateway=gateway,
        server=ServerSettings(shutdown_grace_s=0.2),
        leader_timeout_s=leader_timeout_s,
        stop_grace_s=0.1,
    )


def _port_free(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


async def _settled_tasks(baseline: set[asyncio.Task[object]]) -> set[asyncio.Task[object]]:
    """Tasks other than the baseline still running after a short settle."""
    for _ in range(50):
        left = {t for t in asyncio.all_tasks() if t not in baseline and not t.done()}
        if not left:
            return left
        await asyncio.sleep(0.02)
    return left


async def test_a_gateway_port_taken_stops_the_registry_and_lease_manager() -> None:
    baseline = set(asyncio.all_tasks())
    store = MemoryStore()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        services = _services(
            store, GatewaySettings(host="127.0.0.1", http_port=0, grpc_port=port, hash_secret_hex=SECRET_HEX)
        )
        with pytest.raises(RuntimeError):
            await services.start()
    assert services.lease is not None and services.registry is not None and services.gateway is None
    assert _port_free(services.lease.address), "the lease manager still serves after the failed start"
    assert _port_free(services.registry.address), "the registry still serves after the failed start"
    await services.stop()  # nothing left to stop: a no-op
    await store.close()  # the store (the caller's) owns a task of its own
    assert await _settled_tasks(baseline) == set()


async def test_no_leader_in_time_stops_the_lease_manager_and_starts_nothing_else() -> None:
    store = MemoryStore()
    async with _services(store) as first:
        assert first.lease is not None and first.lease.is_leader
        baseline = set(asyncio.all_tasks())
        second = _services(store, leader_timeout_s=0.5)
        with pytest.raises(TimeoutError, match="did not become leader"):
            await second.start()
        assert second.lease is not None and second.registry is None
        assert _port_free(second.lease.address)
        assert await _settled_tasks(baseline) == set()
        assert first.lease.is_leader
    await store.close()


async def test_a_cancelled_start_stops_what_it_started() -> None:
    store = MemoryStore()
    async with _services(store) as first:
        assert first.lease is not None
        baseline = set(asyncio.all_tasks())
        second = _services(store, leader_timeout_s=60)  # waits for a leadership it never gets
        starting = asyncio.create_task(second.start())
        async with asyncio.timeout(10):
            while second.lease is None or second.lease.address.endswith(":0"):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        assert starting.cancelled()
        assert _port_free(second.lease.address)
        assert await _settled_tasks(baseline) == set()
    await store.close()


async def test_start_and_stop_in_order() -> None:
    store = MemoryStore()
    services = _services(store, GatewaySettings(host="127.0.0.1", http_port=0, grpc_port=0, hash_secret_hex=SECRET_HEX))
    async with services:
        assert services.lease is not None and services.registry is not None and services.gateway is not None
        assert services.registry.settings.lease_service_target == services.lease.address
        assert services.gateway.settings.registry_address == services.registry.address
        assert services.gateway.settings.lease_address == services.lease.address
        addresses = [services.lease.address, services.registry.address, services.gateway.grpc_address]
        assert not any(_port_free(a) for a in addresses)
    assert all(_port_free(a) for a in addresses)
    await store.close()
