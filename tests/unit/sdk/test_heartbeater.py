"""How the shared heartbeater treats the server's renewal statuses (fed synthesized responses)."""

from __future__ import annotations

from kvbridge.lease.v1 import lease_pb2 as pb
from kvbridge.sdk import ClientOptions, Heartbeater, LeaseClient
from kvbridge.sdk.lease import MIN_INTERVAL_S


def _status(key: str, *, alive: bool, tenant: str = "acme", ttl_s: float = 0.0) -> pb.LeaseStatus:
    s = pb.LeaseStatus(
        lease_id=7 if alive else 0,
        alive=alive,
        conversation=pb.ConversationRef(tenant=tenant, model="m", conversation_key=key),
    )
    if ttl_s:
        s.ttl.FromNanoseconds(int(ttl_s * 1e9))
    return s


async def test_conversations_stay_registered_and_loss_is_reported_once() -> None:
    lost: list[pb.LeaseStatus] = []
    client = LeaseClient("127.0.0.1:1", ClientOptions())
    hb = Heartbeater(client, interval_s=5.0, on_lost=lost.append)
    hb.add_conversation("", "m", "k1")  # a tenant API key: the server resolves and reports the tenant
    hb.add_lease(42)
    # Before its first turn is registered a conversation has no lease: not a loss, keep renewing it.
    hb._handle(pb.KeepAliveResponse(statuses=[_status("k1", alive=False)]))
    assert lost == [] and len(hb._batches()) == 2
    hb._handle(pb.KeepAliveResponse(statuses=[_status("k1", alive=True, ttl_s=1.5)]))
    assert hb.interval_s == 0.5  # a third of the shortest TTL seen, below the configured 5 s
    hb._handle(pb.KeepAliveResponse(statuses=[_status("k1", alive=False), _status("k1", alive=False)]))
    assert [s.conversation.conversation_key for s in lost] == ["k1"]  # the lease it had ended: once
    assert any(r.conversations for r in hb._batches())  # still renewed: its next turn brings a new lease
    hb._handle(pb.KeepAliveResponse(statuses=[pb.LeaseStatus(lease_id=42, alive=False)]))
    assert [s.lease_id for s in lost] == [0, 42]
    assert [list(r.lease_ids) for r in hb._batches() if r.lease_ids] == []  # a lost lease id is dropped
    hb.remove_conversation("", "m", "k1")
    assert hb._batches() == []
    hb._handle(pb.KeepAliveResponse(statuses=[_status("k9", alive=True, ttl_s=0.01)]))
    assert hb.interval_s == MIN_INTERVAL_S
    await client.close()


async def test_a_refused_conversation_is_dropped_and_reported() -> None:
    from kvbridge.errors import reason_number

    lost: list[pb.LeaseStatus] = []
    client = LeaseClient("127.0.0.1:1", ClientOptions())
    hb = Heartbeater(client, interval_s=5.0, on_lost=lost.append)
    hb.add_conversation("globex", "m", "k1")  # another tenant's: the server refuses it
    hb.add_conversation("acme", "m", "k2")
    refused = _status("k1", alive=False, tenant="globex")
    refused.error = reason_number("TENANT_FORBIDDEN")  # type: ignore[assignment]
    hb._handle(pb.KeepAliveResponse(statuses=[refused, _status("k2", alive=True)]))
    assert [s.conversation.conversation_key for s in lost] == ["k1"]
    assert [c.conversation_key for r in hb._batches() for c in r.conversations] == ["k2"]  # k1 is not resent
    await client.close()
