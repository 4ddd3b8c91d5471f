"""The lease manager's /metrics over real HTTP after real gRPC traffic: grants, renewals, ends by reason,
live leases by kind, watch subscribers, leadership, plus the shared store and RPC metrics."""

from __future__ import annotations

import asyncio

import httpx
from google.protobuf import duration_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.lease.v1 import lease_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from tests.fixtures.common import free_port

from .harness import lease_app

Samples = dict[str, float]
GRANT = "/kvbridge.lease.v1.LeaseService/GrantLease"


async def scrape(url: str) -> Samples:
    """Every sample as 'name{label="value",...}' (labels sorted) -> value."""
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(url)
    response.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


async def scrape_until(url: str, key: str, value: float, timeout_s: float = 10.0) -> Samples:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        samples = await scrape(url)
        if samples.get(key) == value or asyncio.get_running_loop().time() > deadline:
            assert samples.get(key) == value, f"{key} stayed {samples.get(key)}, not {value}"
            return samples
        await asyncio.sleep(0.05)


def entry(conv: str, ttl_s: int) -> lease_pb2.GrantLeaseRequest:
    return lease_pb2.GrantLeaseRequest(
        kind=lease_pb2.LEASE_KIND_ENTRY,
        tenant="acme",
        engine_id="eng-1",
        model="m",
        conversation_key=conv,
        ttl=duration_pb2.Duration(seconds=ttl_s),
    )


async def test_metrics_follow_grants_renewals_ends_and_watchers() -> None:
    store = MemoryStore()
    async with lease_app(store, metrics_port=free_port()) as (app, stub):
        url = app.metrics_endpoint.url
        before = await scrape(url)
        assert before["kvbridge_lease_is_leader"] == 1
        assert before['kvbridge_lease_live_leases{kind="ENTRY"}'] == 0
        assert before['kvbridge_lease_ended_total{reason="EXPIRED"}'] == 0

        node = (
            await stub.GrantLease(
                lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_NODE, engine_id="eng-1", ttl=duration_pb2.Duration(seconds=30)
                )
            )
        ).lease
        kept = [(await stub.GrantLease(entry(f"c{i}", 30))).lease for i in range(2)]
        await stub.GrantLease(entry("short", 1))

        m = await scrape(url)
        assert m['kvbridge_lease_grants_total{kind="ENTRY"}'] == 3
        assert m['kvbridge_lease_grants_total{kind="NODE"}'] == 1
        assert m['kvbridge_lease_live_leases{kind="ENTRY"}'] == 3
        assert m['kvbridge_lease_live_leases{kind="NODE"}'] == 1
        assert m[f'kvbridge_grpc_server_handled_total{{code="OK",method="{GRANT}"}}'] == 4  # GrpcServer telemetry
        assert m['kvbridge_store_request_seconds_count{op="txn"}'] > 0  # persistence goes through MeteredStore

        renew = lease_pb2.KeepAliveRequest(lease_ids=[k.lease_id for k in kept] + [node.lease_id])
        async for answer in stub.KeepAlive(iter([renew])):
            assert all(s.alive for s in answer.statuses)
        assert (await scrape(url))["kvbridge_lease_renewals_total"] == before["kvbridge_lease_renewals_total"] + 3

        watch = stub.WatchLeases(lease_pb2.WatchLeasesRequest(engine_id="eng-1"))
        first = await watch.read()  # the subscription exists once the snapshot starts arriving
        assert isinstance(first, lease_pb2.WatchLeasesResponse) and first.events
        assert (await scrape(url))["kvbridge_lease_watch_subscribers"] == 1
        watch.cancel()
        await scrape_until(url, "kvbridge_lease_watch_subscribers", 0)

        # The 1 s lease was never renewed: it lapses and is counted once, as EXPIRED.
        m = await scrape_until(url, 'kvbridge_lease_ended_total{reason="EXPIRED"}', 1)
        assert m['kvbridge_lease_live_leases{kind="ENTRY"}'] == 2

        await stub.RevokeLease(
            lease_pb2.RevokeLeaseRequest(lease_id=kept[0].lease_id, reason=types_pb2.REVOKE_REASON_OPERATOR)
        )
        # The engine's last node lease ending takes its remaining entry leases with it (ENGINE_GONE).
        await stub.RevokeLease(
            lease_pb2.RevokeLeaseRequest(lease_id=node.lease_id, reason=types_pb2.REVOKE_REASON_OPERATOR)
        )
        m = await scrape(url)
        assert m['kvbridge_lease_ended_total{reason="OPERATOR"}'] == 2
        assert m['kvbridge_lease_ended_total{reason="ENGINE_GONE"}'] == 1
        assert m['kvbridge_lease_ended_total{reason="EXPIRED"}'] == 1
        assert m['kvbridge_lease_live_leases{kind="ENTRY"}'] == 0
        assert m['kvbridge_lease_live_leases{kind="NODE"}'] == 0

        # A second replica on the same store is a standby: its own /metrics says so.
        standby = LeaseApp(
            store,
            LeasePolicy(port=0, metrics_port=free_port(), leader_ttl_s=2, leader_refresh_s=0.5),
            ServerSettings(shutdown_grace_s=0.5),
        )
        await standby.start()
        try:
            await asyncio.sleep(0.3)
            standing_by = await scrape(standby.metrics_endpoint.url)
            assert standing_by["kvbridge_lease_is_leader"] == 0
            assert standing_by['kvbridge_lease_grants_total{kind="ENTRY"}'] == 0
        finally:
            await standby.stop(0.2)
        assert not standby.metrics_endpoint.url  # stopped with the app


async def test_metrics_endpoint_is_off_by_default() -> None:
    async with lease_app(MemoryStore()) as (app, stub):
        assert not app.metrics_endpoint.enabled and not app.metrics_endpoint.url
        with_no_lease = lease_pb2.KeepAliveRequest(lease_ids=[1])
        async for answer in stub.KeepAlive(iter([with_no_lease])):
            assert not answer.statuses[0].alive
        # Not alive: not a renewal.
        assert app.manager.renewals == 0
