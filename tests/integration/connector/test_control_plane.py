"""The connector's control-plane thread against real registry + lease processes on real etcd."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_connector import control_plane as cp
from kvbridge_connector.params import ConversationRef
from kvbridge_connector.settings import ConnectorSettings
from tests.fixtures.common import require_etcd_binary
from tests.fixtures.control_plane_procs import ControlPlaneProcs, run_control_plane

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

SECRET = b"integration-secret-0123456789"
CONV = ConversationRef(tenant="acme", model="tiny", conversation_key="conv-1", epoch=1)
TOKENS = tuple(range(8, 8 + 100))  # 3 full blocks of 32 + 4 tokens


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcs]:
    require_etcd_binary()
    with run_control_plane(Path(tmp_path_factory.mktemp("cp"))) as running:
        yield running


def engine(engine_id: str) -> types_pb2.Engine:
    return types_pb2.Engine(
        engine_id=engine_id,
        role=types_pb2.ENGINE_ROLE_DECODE,
        model="tiny",
        kv_host="127.0.0.1",
        kv_port=5555,
        block_size=32,
        kv_group_count=1,
        total_kv_blocks=1000,
        dp_size=1,
        tp_size=1,
        pp_size=1,
        dcp_size=1,
    )


@pytest.fixture
def plane(procs: ControlPlaneProcs, request: pytest.FixtureRequest) -> Iterator[cp.ControlPlane]:
    settings = ConnectorSettings(
        registry_target=procs.registry_target,
        lease_target=procs.lease_target,
        hash_secret=SECRET,
        entry_lease_ttl_s=30,
        node_lease_ttl_s=3,
    )
    running = cp.ControlPlane(settings, engine(f"decode-{request.node.name[:40]}".replace("_", "-")))
    running.start()
    yield running
    running.stop()


def wait_events(
    plane: cp.ControlPlane, until: Callable[[list[cp.Event]], bool], timeout_s: float = 20
) -> list[cp.Event]:
    seen: list[cp.Event] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.extend(plane.drain())
        if until(seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"events never matched: {seen}")


def test_connects_registers_engine_and_entry_then_follows_revocation(
    plane: cp.ControlPlane, procs: ControlPlaneProcs
) -> None:
    wait_events(plane, lambda ev: any(isinstance(e, cp.Connection) and e.up for e in ev))
    plane.submit(cp.RegisterEntry("req-1", CONV, ((4, 5, 6, 7),), TOKENS, ""))
    events = wait_events(plane, lambda ev: any(isinstance(e, cp.LeaseBound) for e in ev))
    bound = next(e for e in events if isinstance(e, cp.LeaseBound))
    assert bound.request_id == "req-1" and bound.lease_id > 0

    with grpc.insecure_channel(procs.registry_target) as channel:
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        key = registry_pb2.EntryKey(tenant="acme", model="tiny", conversation_key="conv-1")
        entry = registry.GetEntry(registry_pb2.GetEntryRequest(key=key), timeout=5).entry
        assert entry.engine_request_id == "req-1" and entry.token_count == len(TOKENS)
        assert entry.lease_id == bound.lease_id and list(entry.block_ids[0].ids) == [4, 5, 6, 7]
        registered = registry.GetEngine(registry_pb2.GetEngineRequest(engine_id=plane_engine_id(plane)), timeout=5)
        assert registered.engine.node_lease_id > 0
        assert entry.engine_incarnation == registered.engine.node_lease_id  # bound to this process
        # The registry verifies the chain we registered: a prompt extending the tokens hits.
        chain = hashchain.chain(SECRET, "acme", "tiny", "", 32, [*TOKENS, 1, 2, 3])
        hit = registry.LookupEntry(
            registry_pb2.LookupEntryRequest(
                tenant="acme", model="tiny", conversation_key="conv-1", block_hashes=chain, block_size=32
            ),
            timeout=5,
        )
        assert hit.verdict == registry_pb2.LOOKUP_VERDICT_HIT and hit.verified_tokens == 96

    with grpc.insecure_channel(procs.lease_target) as channel:
        lease_pb2_grpc.LeaseServiceStub(channel).RevokeLease(
            lease_pb2.RevokeLeaseRequest(lease_id=bound.lease_id, reason=types_pb2.REVOKE_REASON_CLIENT_CLOSED),
            timeout=5,
        )
    events = wait_events(plane, lambda ev: any(isinstance(e, cp.LeaseEnded) for e in ev))
    ended = next(e for e in events if isinstance(e, cp.LeaseEnded))
    assert ended.lease_id == bound.lease_id and ended.reason == "REVOKE_REASON_CLIENT_CLOSED"


def test_revoke_command_ends_the_lease(plane: cp.ControlPlane) -> None:
    wait_events(plane, lambda ev: any(isinstance(e, cp.Connection) and e.up for e in ev))
    conv = ConversationRef(tenant="acme", model="tiny", conversation_key="conv-2", epoch=1)
    plane.submit(cp.RegisterEntry("req-2", conv, ((1,),), TOKENS[:32], ""))
    bound = next(
        e
        for e in wait_events(plane, lambda ev: any(isinstance(e, cp.LeaseBound) for e in ev))
        if isinstance(e, cp.LeaseBound)
    )
    plane.submit(cp.RevokeLease(bound.lease_id, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE"))
    # Confirmed twice: by the acknowledged revoke, and by the watch's ENDED event (the retention table takes
    # the first and ignores the second).
    events = wait_events(plane, lambda ev: sum(isinstance(e, cp.LeaseEnded) for e in ev) >= 2)
    ended = [(e.lease_id, e.reason) for e in events if isinstance(e, cp.LeaseEnded)]
    assert ended == [(bound.lease_id, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")] * 2


def test_a_restart_under_the_same_engine_id_ends_the_previous_process_entries(procs: ControlPlaneProcs) -> None:
    settings = ConnectorSettings(
        registry_target=procs.registry_target,
        lease_target=procs.lease_target,
        hash_secret=SECRET,
        entry_lease_ttl_s=30,
        node_lease_ttl_s=30,
    )
    conv = ConversationRef(tenant="acme", model="tiny", conversation_key="conv-restart", epoch=1)
    first = cp.ControlPlane(settings, engine("decode-restarted"))
    first.start()
    try:
        wait_events(first, lambda ev: any(isinstance(e, cp.Connection) and e.up for e in ev))
        first.submit(cp.RegisterEntry("req-r1", conv, ((4, 5, 6),), TOKENS[:96], ""))
        bound = next(
            e
            for e in wait_events(first, lambda ev: any(isinstance(e, cp.LeaseBound) for e in ev))
            if isinstance(e, cp.LeaseBound)
        )
        with grpc.insecure_channel(procs.registry_target) as channel:
            first_node_lease = (
                registry_pb2_grpc.RegistryServiceStub(channel)
                .GetEngine(registry_pb2.GetEngineRequest(engine_id="decode-restarted"), timeout=5)
                .engine.node_lease_id
            )
    finally:
        first.stop()  # the process dies; its node lease (30 s) outlives it
    second = cp.ControlPlane(settings, engine("decode-restarted"))  # a new process under the same id
    second.start()
    try:
        wait_events(second, lambda ev: any(isinstance(e, cp.Connection) and e.up for e in ev))
        chain = hashchain.chain(SECRET, "acme", "tiny", "", 32, list(TOKENS[:96]))
        with (
            grpc.insecure_channel(procs.registry_target) as channel,
            grpc.insecure_channel(procs.lease_target) as lease_channel,
        ):
            registry = registry_pb2_grpc.RegistryServiceStub(channel)
            leases = lease_pb2_grpc.LeaseServiceStub(lease_channel)
            deadline = time.monotonic() + 20
            # The new process registers its engine record (a new node lease) on its own schedule; "connected"
            # (its lease watch is up) says nothing about that. From the registration on, the old entry is
            # refused by every lookup of this replica.
            while registry.GetEngine(
                registry_pb2.GetEngineRequest(engine_id="decode-restarted"), timeout=5
            ).engine.node_lease_id in (0, first_node_lease):
                assert time.monotonic() < deadline, "the restarted engine never registered"
                time.sleep(0.05)
            while True:  # the old entry: never a hit; deleted, and its lease revoked through the lease manager
                got = registry.LookupEntry(
                    registry_pb2.LookupEntryRequest(
                        tenant="acme", model="tiny", conversation_key="conv-restart", block_hashes=chain, block_size=32
                    ),
                    timeout=5,
                )
                assert got.verdict != registry_pb2.LOOKUP_VERDICT_HIT
                try:
                    leases.GetLease(lease_pb2.GetLeaseRequest(lease_id=bound.lease_id), timeout=5)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND and got.verdict == registry_pb2.LOOKUP_VERDICT_NOT_FOUND:
                        break
                assert time.monotonic() < deadline, got
                time.sleep(0.1)
    finally:
        second.stop()


@pytest.mark.serial  # a time bound (scripts/test)
def test_unreachable_control_plane_never_blocks_submit() -> None:
    settings = ConnectorSettings(
        registry_target="127.0.0.1:9", lease_target="127.0.0.1:9", hash_secret=SECRET, rpc_deadline_s=0.2, queue_size=16
    )
    plane = cp.ControlPlane(settings, engine("decode-unreachable"))
    plane.start()
    try:
        started = time.monotonic()
        accepted = sum(plane.submit(cp.RegisterEntry(f"r{i}", CONV, ((1,),), TOKENS, "")) for i in range(100))
        assert time.monotonic() - started < 1.0  # generous: submit is a non-blocking queue put
        assert accepted < 100 and plane.dropped_commands == 100 - accepted
        assert not any(isinstance(e, cp.LeaseBound) for e in plane.drain())
    finally:
        plane.stop()


def plane_engine_id(plane: cp.ControlPlane) -> str:
    return plane.engine_id
