"""etcd's NOSPACE alarm, raised for real: one etcd with a 16 MiB quota (--quota-backend-bytes) filled by big puts
under the in-process stack (lease manager leader + a standby, registry, gateway, engine simulators as P and D).

While writes are refused: turns still answer through the gateway, equal to answers without reuse (fail open to
recompute); a registration and a lease grant answer UNAVAILABLE with the reason STORE_NO_SPACE; the registry and the
lease manager stay SERVING (reads go on) while their health name ``kvbridge.store`` is NOT_SERVING and
``kvbridge_store_writes_refused`` is 1; the store logs the episode once however many writes fail; the lease leader
stays leader and the standby a standby (sampled every 50 ms across several leader TTLs). Then the runbook's steps
(delete the filler, compact, defragment, disarm) and the services take writes again without a restart: health,
gauge, a lease grant and a conversation that hits. The recovery runs the runbook's etcdctl commands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from etcd3aio._protobuf import KVStub, PutRequest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.errors import Reason, from_rpc_error
from kvbridge.lease.v1 import lease_pb2
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.etcd import EtcdStore
from kvbridge_services.common.store_space import STORE_HEALTH
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from tests.fixtures.common import missing
from tests.fixtures.etcd import EtcdServer

from .conftest import MODEL
from .simstack import Stack, conversation

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

QUOTA = 16 * 1024 * 1024
CHUNK = 1024 * 1024  # under etcd's 1.5 MiB request limit
HOLD_S = 8.0  # NOSPACE held this long: 4 leader TTLs (2 s), two standby rechecks


async def _fill(endpoint: str) -> int:
    """Puts 1 MiB values under /fill/ (etcd's own client API, as any other etcd user would) until etcd refuses
    one with NOSPACE; the number written."""
    value = b"x" * CHUNK
    async with grpc.aio.insecure_channel(endpoint) as ch:
        kv = KVStub(ch)
        for i in range(10 * QUOTA // CHUNK):
            try:
                await kv.Put(PutRequest(key=f"/fill/{i:04d}".encode(), value=value), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "database space exceeded" in (exc.details() or ""), exc
                return i
    raise AssertionError(f"etcd took {10 * QUOTA} bytes under a {QUOTA}-byte quota")


async def _health(target: str, service: str) -> str:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _gauge(app: object) -> float | None:
    value: float | None = app.telemetry.registry.get_sample_value("kvbridge_store_writes_refused")  # type: ignore[attr-defined]
    return value


def _etcdctl(endpoint: str, *args: str) -> str:
    """One etcdctl command (v3 API), as docs/etcd-space.md gives it; its output."""
    binary = shutil.which("etcdctl")
    if binary is None:
        missing("etcdctl", "scripts/install (apt etcd-client)")
    done = subprocess.run(
        [binary, f"--endpoints={endpoint}", *args],
        env={**os.environ, "ETCDCTL_API": "3"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"
    return done.stdout


def _recover(endpoint: str) -> tuple[float, str, str]:
    """The runbook (docs/etcd-space.md), with etcdctl: see the alarm, delete what filled it (deletes are taken at
    NOSPACE), compact to the current revision, defragment, disarm. Returns when disarmed, with the alarm list before
    and after."""
    before = _etcdctl(endpoint, "alarm", "list")
    _etcdctl(endpoint, "del", "--prefix", "/fill/")
    status = json.loads(_etcdctl(endpoint, "endpoint", "status", "--write-out=json"))
    _etcdctl(endpoint, "compact", str(status[0]["Status"]["header"]["revision"]), "--physical")
    _etcdctl(endpoint, "defrag")
    _etcdctl(endpoint, "alarm", "disarm")
    return time.monotonic(), before, _etcdctl(endpoint, "alarm", "list")


async def test_nospace_fails_open_keeps_leadership_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server = EtcdServer(base_dir=tmp_path / "etcd", quota_backend_bytes=QUOTA)
    server.start()
    store = EtcdStore([server.endpoint], timeout=2.0)
    try:
        async with Stack(store) as stack:
            standby = LeaseApp(
                store,
                LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5, store_timeout_s=1.0),
                ServerSettings(shutdown_grace_s=0.2),
            )
            await standby.start()
            try:
                await _scenario(stack, standby, server, store, caplog)
            finally:
                await standby.stop(0.1)
    finally:
        await store.close()
        server.close()


async def _scenario(
    stack: Stack,
    standby: LeaseApp,
    server: EtcdServer,
    store: EtcdStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    msgs, verdicts, wrong = await conversation(stack, "c-before", 2)
    assert wrong == 0 and verdicts[-1].startswith("hit;"), verdicts
    assert stack.lease.is_leader and not standby.is_leader
    assert await _health(stack.registry.address, STORE_HEALTH) == "SERVING"

    # Leadership sampled every 50 ms from before the alarm until after recovery.
    flips: list[tuple[float, bool, bool]] = []
    sampling = True

    async def sample() -> None:
        last = (stack.lease.is_leader, standby.is_leader)
        while sampling:
            now = (stack.lease.is_leader, standby.is_leader)
            if now != last:
                flips.append((time.monotonic(), *now))
                last = now
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    written = await _fill(server.endpoint)
    alarm_at = time.monotonic()
    print(f"NOSPACE after {written} x 1 MiB puts in {alarm_at - started:.1f}s (quota {QUOTA >> 20} MiB)")

    # Services' writes are refused with their own reason.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.lease_stub.GrantLease(
            lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant="acme",
                engine_id="d0",
                model=MODEL,
                conversation_key="c-refused",
                ttl=Duration(seconds=60),
            ),
            timeout=10,
        )
    error = from_rpc_error(refused.value)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert error.reason == Reason.STORE_NO_SPACE, error

    # Turns answer, equal to recompute: the conversation begun before and a new one.
    turns_started = time.monotonic()
    msgs, during_old, wrong_old = await conversation(stack, "c-before", 2, msgs)
    _, during_new, wrong_new = await conversation(stack, "c-during", 3)
    turns_s = time.monotonic() - turns_started
    print(f"turns during NOSPACE: c-before {during_old} c-during {during_new} in {turns_s:.1f}s")
    assert wrong_old == 0 and wrong_new == 0
    assert not any(v.startswith("hit;") for v in during_new[1:]), "nothing new could be registered"

    # Readiness says why; serving itself stays.
    for target in (stack.registry.address, stack.lease.address):
        assert await _health(target, STORE_HEALTH) == "NOT_SERVING"
        assert await _health(target, "") == "SERVING"
    assert _gauge(stack.registry) == 1.0 and _gauge(stack.lease) == 1.0
    assert store.writes_refused() is not None

    # Held past several leader TTLs: the leader leads, the standby waits.
    await asyncio.sleep(max(0.0, HOLD_S - (time.monotonic() - alarm_at)))
    assert stack.lease.is_leader and not standby.is_leader

    recovered_at, alarms_before, alarms_after = await asyncio.to_thread(_recover, server.endpoint)
    assert "alarm:NOSPACE" in alarms_before and alarms_after.strip() == "", (alarms_before, alarms_after)
    async with asyncio.timeout(10):
        while store.writes_refused() is not None:  # noqa: ASYNC110 - polling the store's state
            await asyncio.sleep(0.05)
    noticed_s = time.monotonic() - recovered_at
    async with asyncio.timeout(5):
        while await _health(stack.registry.address, STORE_HEALTH) != "SERVING":  # noqa: ASYNC110 - polling health
            await asyncio.sleep(0.05)
    healthy_s = time.monotonic() - recovered_at
    sampling = False
    await sampler

    grant = await stack.lease_stub.GrantLease(
        lease_pb2.GrantLeaseRequest(
            kind=lease_pb2.LEASE_KIND_ENTRY,
            tenant="acme",
            engine_id="d0",
            model=MODEL,
            conversation_key="c-after-grant",
            ttl=Duration(seconds=60),
        ),
        timeout=10,
    )
    assert grant.lease.lease_id
    first_write_s = time.monotonic() - recovered_at
    _, after, wrong_after = await conversation(stack, "c-after", 2)
    assert wrong_after == 0 and after[-1].startswith("hit;"), after
    assert await _health(stack.lease.address, STORE_HEALTH) == "SERVING"
    assert _gauge(stack.registry) == 0.0 and _gauge(stack.lease) == 0.0
    assert stack.lease.is_leader and not standby.is_leader
    assert flips == [], f"leadership changed during NOSPACE: {flips}"

    episodes = [r for r in caplog.records if r.getMessage().startswith("etcd refuses writes")]
    refused_campaigns = [r for r in caplog.records if "cannot campaign while the store refuses" in r.getMessage()]
    gateway_lines = [r for r in caplog.records if "compatibility-mode registration" in r.getMessage()]
    failed_writes = sum(
        1 for r in caplog.records if "STORE_NO_SPACE" in r.getMessage() or "space exceeded" in r.getMessage()
    )
    print(
        f"NOSPACE held {recovered_at - alarm_at:.1f}s; after disarm: store noticed in {noticed_s:.2f}s, health "
        f"SERVING in {healthy_s:.2f}s, a lease grant in {first_write_s:.2f}s; episode log lines={len(episodes)} "
        f"(store errors: {store.no_space_episodes} episode(s)); standby campaign warnings={len(refused_campaigns)}; "
        f"log records naming the cause={failed_writes}; gateway registration lines={len(gateway_lines)}; "
        f"leadership flips={len(flips)}"
    )
    assert len(episodes) == 1, [r.getMessage() for r in episodes]
    assert store.no_space_episodes == 1
    assert len(refused_campaigns) <= 1
    assert len(gateway_lines) == 1, "the gateway's failed registrations are logged once per episode"
