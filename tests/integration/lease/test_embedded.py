"""The lease manager on the embedded store (single-node mode), real gRPC."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import duration_pb2

from kvbridge.lease.v1 import lease_pb2
from kvbridge_services.common.store.memory import MemoryStore
from tests.fixtures.common import read_message

from .harness import lease_app


def request(conv: str) -> lease_pb2.GrantLeaseRequest:
    return lease_pb2.GrantLeaseRequest(
        kind=lease_pb2.LEASE_KIND_ENTRY,
        tenant="acme",
        engine_id="eng-1",
        model="m",
        conversation_key=conv,
        ttl=duration_pb2.Duration(seconds=30),
    )


async def test_restart_on_a_durable_embedded_store_recovers_leases(tmp_path: Path) -> None:
    store = MemoryStore(data_dir=tmp_path)
    async with lease_app(store) as (_app, stub):
        ids = {(await stub.GrantLease(request(f"c{i}"))).lease.lease_id for i in range(10)}
        call = stub.KeepAlive()
        await call.write(
            lease_pb2.KeepAliveRequest(
                conversations=[lease_pb2.ConversationRef(tenant="acme", model="m", conversation_key="c3")]
            )
        )
        [status] = (await read_message(call, lease_pb2.KeepAliveResponse)).statuses
        assert status.alive and status.lease_id in ids and status.conversation.conversation_key == "c3"
        await call.done_writing()
    await store.close()

    reopened = MemoryStore(data_dir=tmp_path)
    async with lease_app(reopened) as (_app, stub):
        page = await stub.ListLeases(lease_pb2.ListLeasesRequest(page_size=4))
        seen = [lease.lease_id for lease in page.leases]
        while page.next_page_token:
            page = await stub.ListLeases(lease_pb2.ListLeasesRequest(page_size=4, page_token=page.next_page_token))
            seen.extend(lease.lease_id for lease in page.leases)
        assert sorted(seen) == sorted(ids)
    await reopened.close()
