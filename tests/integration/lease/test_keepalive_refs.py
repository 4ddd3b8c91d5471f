"""A KeepAlive message naming a bad conversation: that ref is refused in its status, and the rest of the
message, and of the stream, is renewed as usual (one bad ref must not end a shared Heartbeater's stream)."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2

from kvbridge.errors import reason_name
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge_services.common.auth import Authenticator, Principal, Role
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.lease.app import LeaseApp
from kvbridge_services.lease.policy import LeasePolicy
from tests.fixtures.common import read_message

from .harness import wait_until

ACME = (("authorization", "Bearer key-acme"),)


def ref(key: str, tenant: str = "") -> lease_pb2.ConversationRef:
    return lease_pb2.ConversationRef(tenant=tenant, model="m", conversation_key=key)


async def test_a_refused_ref_leaves_the_message_and_the_stream_working() -> None:
    store = MemoryStore()
    auth = Authenticator(
        {
            "key-acme": Principal("acme-app", "acme"),
            "key-engine": Principal("connector", None, frozenset({Role.ENGINE})),
        }
    )
    app = LeaseApp(
        store,
        LeasePolicy(port=0, leader_ttl_s=2, leader_refresh_s=0.5),
        ServerSettings(shutdown_grace_s=0.2),
        auth=auth,
    )
    await app.start()
    channel = grpc.aio.insecure_channel(app.address)
    try:
        await wait_until(lambda: app.is_leader)
        stub = lease_pb2_grpc.LeaseServiceStub(channel)
        granted = await stub.GrantLease(
            lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant="acme",
                engine_id="d0",
                model="m",
                conversation_key="c1",
                ttl=duration_pb2.Duration(seconds=30),
            ),
            metadata=(("authorization", "Bearer key-engine"),),
        )
        lease_id = granted.lease.lease_id
        call = stub.KeepAlive(metadata=ACME)
        await call.write(
            lease_pb2.KeepAliveRequest(
                lease_ids=[lease_id], conversations=[ref("bad\x00key"), ref("c1", tenant="globex"), ref("c1")]
            )
        )
        by_lease, bad, foreign, good = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert by_lease.alive and by_lease.lease_id == lease_id
        assert not bad.alive and reason_name(bad.error) == "INVALID_FIELD"
        assert not foreign.alive and reason_name(foreign.error) == "TENANT_FORBIDDEN"
        assert good.alive and good.lease_id == lease_id and not good.error
        await call.write(lease_pb2.KeepAliveRequest(conversations=[ref("c1")]))  # the stream is still open
        [again] = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert again.alive and again.lease_id == lease_id
        await call.done_writing()
    finally:
        await channel.close()
        await app.stop(0.2)
        await store.close()
