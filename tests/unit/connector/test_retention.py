"""Scheduler-side retention rules, without engines (fake clock)."""

from __future__ import annotations

from kvbridge_connector.params import ConversationRef
from kvbridge_connector.retention import REVOKE_RETRY_S, Decisions, RetentionTable, WithdrawReason

CONV = ConversationRef(tenant="acme", model="tiny", conversation_key="c1", epoch=1)
TTL = 100.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(clock: FakeClock, max_entries: int = 100, watermark: float = 0.2) -> RetentionTable:
    return RetentionTable(clock, fallback_ttl_s=TTL, max_entries=max_entries, free_kv_watermark=watermark)


def test_retain_sets_a_bounded_fallback_deadline() -> None:
    clock = FakeClock()
    table = make_table(clock)
    assert table.retain("r1", num_blocks=4, token_count=100, conversation=CONV) == 1000.0 + TTL
    assert "r1" in table and table.retained_blocks() == 4


def test_unconfirmed_entry_is_never_extended() -> None:
    """Control plane unreachable: no lease, no extension; the worker frees at the fallback deadline."""
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    for _ in range(10):
        clock.now += TTL / 4
        decisions = table.step(None, None)
        assert decisions.deadlines == {} and decisions.release == set()


def test_live_lease_keeps_extending_the_hold_past_the_fallback_ttl() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.set_connected(True)
    table.bind_lease("r1", 7)
    sent: list[float] = []
    for _ in range(12):  # 3x the fallback TTL
        clock.now += TTL / 4
        sent.extend(table.step(None, None).deadlines.values())
    assert sent, "the worker must be told about extensions"
    assert max(sent) >= clock.now + TTL / 2


def test_disconnect_stops_extensions() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.set_connected(True)
    table.bind_lease("r1", 7)
    clock.now += TTL
    table.step(None, None)
    table.set_connected(False)
    last = table.get("r1")
    assert last is not None
    frozen = last.hold_deadline
    clock.now += 10 * TTL
    table.step(None, None)
    assert table.get("r1").hold_deadline == frozen  # type: ignore[union-attr]


def test_ended_lease_releases_now_and_freed_forgets() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.bind_lease("r1", 7)
    table.lease_ended(7)
    decisions = table.step(None, None)
    assert decisions.release == {"r1"} and decisions.revoke == []
    table.freed("r1")
    assert "r1" not in table


def test_lease_ended_before_grant_arrived_releases_on_bind() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.lease_ended(7)
    table.bind_lease("r1", 7)
    assert table.step(None, None).release == {"r1"}


def test_grant_for_already_freed_entry_is_revoked() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.freed("r1")
    table.bind_lease("r1", 9)
    assert table.step(None, None).revoke == [(9, "REVOKE_REASON_EXPIRED")]


def test_freed_by_fallback_deadline_revokes_live_lease() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.bind_lease("r1", 7)
    table.freed("r1")  # the worker reaped it at the deadline
    assert table.step(None, None).revoke == [(7, "REVOKE_REASON_EXPIRED")]


def test_snapshot_frees_entries_whose_lease_is_missing() -> None:
    clock = FakeClock()
    table = make_table(clock)
    table.retain("r1", 4, 100, CONV)
    table.retain("r2", 4, 100, CONV)
    table.retain("r3", 4, 100, CONV)  # grant still in flight: kept
    table.bind_lease("r1", 1)
    table.bind_lease("r2", 2)
    table.snapshot({2})
    assert table.step(None, None).release == {"r1"}


def test_watermark_withdraws_oldest_idle_first_and_frees_once_the_revoke_is_confirmed() -> None:
    clock = FakeClock()
    table = make_table(clock, watermark=0.2)
    for index, name in enumerate(["old", "mid", "new"]):
        table.retain(name, 10, 320, CONV)
        table.bind_lease(name, index + 1)
        clock.now += 1
    table.lease_alive(1)  # "old" was just renewed: now the most recently used
    # 100 blocks, 12 free: need 20 free -> 8 blocks short, and a batch of 10 % of the cache more: "mid" and "new".
    decisions = table.step(free_blocks=12, total_blocks=100)
    assert decisions.revoke == [
        (2, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE"),
        (3, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE"),
    ]
    assert decisions.release == set(), "a READ offered before the revoke may still come: never free at once"
    # Next step, still short: "mid"'s blocks are on their way out and count as freed already.
    assert table.step(free_blocks=12, total_blocks=100) == Decisions()
    table.lease_ended(2)  # the lease manager confirms the end
    assert table.step(free_blocks=12, total_blocks=100).release == {"mid"}


def test_an_unconfirmed_withdrawal_is_asked_again_and_held_while_connected() -> None:
    clock = FakeClock()
    table = make_table(clock, max_entries=1)
    table.set_connected(True)
    for lease, name in ((1, "a"), (2, "b")):
        table.retain(name, 1, 32, CONV)
        table.bind_lease(name, lease)
        clock.now += 1
    assert table.step(None, None).revoke == [(1, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")]
    for _ in range(int(3 * TTL / REVOKE_RETRY_S)):  # long past the fallback TTL
        clock.now += REVOKE_RETRY_S
        decisions = table.step(None, None)
        assert decisions.release == set()
        assert decisions.revoke == [(1, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")]
    assert table.get("a") is not None and table.get("a").hold_deadline > clock.now  # type: ignore[union-attr]


def test_a_withdrawal_during_the_registration_revokes_the_lease_when_it_arrives() -> None:
    clock = FakeClock()
    table = make_table(clock, max_entries=1)
    table.retain("a", 1, 32, CONV)
    clock.now += 1
    table.retain("b", 1, 32, CONV)
    # "a" withdrawn, but its grant is still in flight: nothing to revoke yet.
    assert table.step(None, None) == Decisions(withdrawn=[("a", WithdrawReason.ENTRY_CAP)])
    table.bind_lease("a", 5)
    assert table.step(None, None).revoke == [(5, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")]
    table.lease_ended(5)
    assert table.step(None, None).release == {"a"}


def test_a_failed_registration_frees_when_no_entry_can_name_the_blocks() -> None:
    clock = FakeClock()
    table = RetentionTable(clock, fallback_ttl_s=TTL, max_entries=100, free_kv_watermark=0.2, free_grace_s=GRACE)
    for name in ("never-granted", "refused", "revoked", "unknown"):
        table.retain(name, 1, 32, CONV)
    table.registration_failed("never-granted", 0, withdrawn=True)
    table.registration_failed("refused", 9, withdrawn=True, written=False)  # the registry stored nothing
    table.registration_failed("revoked", 7, withdrawn=True)  # timed out, then revoked: may have been offered
    table.registration_failed("unknown", 8, withdrawn=False)  # timed out and the revoke failed: may be registered
    decisions = table.step(None, None)
    assert decisions.release == {"never-granted", "refused"} and decisions.revoke == [(8, "REVOKE_REASON_EXPIRED")]
    clock.now += GRACE
    assert table.step(None, None).release == {"revoked"}
    table.lease_ended(8)
    clock.now += GRACE
    assert table.step(None, None).release == {"unknown"}


GRACE = 10.0


def test_an_ended_lease_frees_its_blocks_only_after_the_grace() -> None:
    """A prefill sent just before the lease ended may still be reading the blocks (one-sided NIXL READ)."""
    clock = FakeClock()
    table = RetentionTable(clock, fallback_ttl_s=TTL, max_entries=100, free_kv_watermark=0.2, free_grace_s=GRACE)
    table.retain("r1", 4, 100, CONV)
    table.bind_lease("r1", 7)
    table.set_connected(True)
    table.lease_ended(7)
    clock.now += GRACE - 1
    first = table.step(1000, 1000)
    assert first.release == set() and first.deadlines == {}
    entry = table.get("r1")
    assert entry is not None and entry.released  # no longer extended nor offered
    clock.now += 1
    assert table.step(1000, 1000).release == {"r1"}
    table.freed("r1")
    assert table.step(1000, 1000).release == set()


def test_memory_pressure_never_cuts_the_grace_short() -> None:
    clock = FakeClock()
    table = RetentionTable(clock, fallback_ttl_s=TTL, max_entries=100, free_kv_watermark=0.2, free_grace_s=GRACE)
    for i, lease in ((1, 11), (2, 12)):
        table.retain(f"r{i}", 10, 100, CONV)
        table.bind_lease(f"r{i}", lease)
    table.lease_ended(11)
    # 10 blocks short of the watermark (20 of 100 free wanted): the ended entry's blocks cover it once freed,
    # so no live entry is withdrawn, and nothing is freed before the grace.
    assert table.step(10, 100) == Decisions()
    clock.now += GRACE
    assert table.step(10, 100).release == {"r1"}


def test_the_entry_cap_withdraws_the_oldest_and_frees_after_the_grace() -> None:
    clock = FakeClock()
    table = RetentionTable(clock, fallback_ttl_s=TTL, max_entries=1, free_kv_watermark=0.2, free_grace_s=GRACE)
    table.retain("r1", 4, 100, CONV)
    table.bind_lease("r1", 1)
    clock.now += 1
    table.retain("r2", 4, 100, CONV)
    table.bind_lease("r2", 2)
    decisions = table.step(None, None)
    assert decisions.release == set() and decisions.revoke == [(1, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")]
    table.lease_ended(1)
    clock.now += GRACE - 0.5
    assert table.step(None, None).release == set()
    clock.now += 0.5
    assert table.step(None, None).release == {"r1"}
