"""gRPC health of lease-manager replicas: only the leader is SERVING (overall "" and LeaseService), so a
Service or load balancer that checks health routes to it; "liveness" is SERVING on every running replica."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.lease.app import LIVENESS, SERVICE_NAME, LeaseApp
from tests.fixtures.etcd import EtcdServer

from .harness import lease_app, wait_until

pytestmark = pytest.mark.etcd
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            name: (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
            for name in ("", SERVICE_NAME, LIVENESS)
        }


async def test_only_the_leader_reports_serving_and_a_standby_turns_serving_when_it_takes_over(
    etcd_server: EtcdServer,
) -> None:
    store = EtcdStore([etcd_server.endpoint])
    try:
        async with lease_app(store) as (leader, _):
            standby = LeaseApp(store, leader.policy, ServerSettings(shutdown_grace_s=0.5))
            await standby.start()
            try:
                assert await _health(leader.address) == {"": SERVING, SERVICE_NAME: SERVING, LIVENESS: SERVING}
                assert await _health(standby.address) == {"": NOT_SERVING, SERVICE_NAME: NOT_SERVING, LIVENESS: SERVING}
                await leader.stop(0.2)  # resigns: the standby takes over
                await wait_until(lambda: standby.is_leader, timeout_s=20)
                assert await _health(standby.address) == {"": SERVING, SERVICE_NAME: SERVING, LIVENESS: SERVING}
            finally:
                await standby.stop(0.2)
    finally:
        await store.close()
