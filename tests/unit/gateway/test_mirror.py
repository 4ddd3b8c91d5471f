"""The gateway's entry mirror: what it may answer, and when it must leave the answer to the registry."""

from __future__ import annotations

import pytest

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.gateway.control import KeyedLookup
from kvbridge_services.gateway.mirror import EntryMirror

SECRET = b"s" * 32
BLOCK = 16
TOKENS = list(range(1000, 1000 + 160))  # 10 blocks
ENGINE = types_pb2.Engine(engine_id="d0", kv_host="127.0.0.1", kv_port=5600, block_size=BLOCK, tp_size=1)
PUT, DELETE = registry_pb2.EntryEvent.TYPE_PUT, registry_pb2.EntryEvent.TYPE_DELETE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chain(tokens: list[int]) -> list[bytes]:
    return hashchain.chain(SECRET, "acme", "m", "", BLOCK, tokens)


def entry(
    tokens: list[int], *, conv: str = "c1", epoch: int = 1, request_id: str = "r1", expire_s: int | None = None
) -> registry_pb2.Entry:
    hashes = chain(tokens)
    n = len(tokens) // BLOCK
    e = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key=conv),
        engine_id="d0",
        engine_request_id=request_id,
        block_ids=[types_pb2.BlockIds(ids=list(range(50, 50 + n)))],
        block_size=BLOCK,
        token_count=len(tokens),
        block_hashes=hashes,
        chain_stride=1,
        final_block_hash=hashes[-1],
        lease_id=7,
        epoch=epoch,
    )
    if expire_s is not None:
        e.expire_time.seconds = expire_s
    return e


def message(
    *events: tuple[registry_pb2.EntryEvent.Type.ValueType, registry_pb2.Entry, int],
    complete: bool = False,
    revision: int = 0,
) -> registry_pb2.WatchEntriesResponse:
    return registry_pb2.WatchEntriesResponse(
        events=[registry_pb2.EntryEvent(type=t, entry=e, revision=r) for t, e, r in events],
        snapshot_complete=complete,
        revision=revision,
    )


def lookup(
    mirror: EntryMirror,
    tokens: list[int],
    *,
    conv: str = "c1",
    min_tokens: int = 64,
    engines: dict[str, types_pb2.Engine] | None = None,
) -> registry_pb2.LookupEntryResponse | None:
    known = {"d0": ENGINE} if engines is None else engines
    return mirror.lookup(
        KeyedLookup(
            tenant="acme",
            model="m",
            conversation_key=conv,
            block_hashes=chain(tokens),
            block_size=BLOCK,
            min_tokens=min_tokens,
        ),
        engine_record=known.get,
    )


def synced_mirror(*entries: registry_pb2.Entry, clock: Clock | None = None, wall_s: float = 1_000.0) -> EntryMirror:
    mirror = EntryMirror(max_entries=100, stale_after_s=3.0, clock=clock or Clock(), wall_clock=lambda: wall_s)
    mirror.apply(message(*((PUT, e, 10 + i) for i, e in enumerate(entries)), complete=True, revision=20))
    return mirror


def test_a_verified_prefix_is_answered_like_the_registry() -> None:
    mirror = synced_mirror(entry(TOKENS))
    found = lookup(mirror, [*TOKENS, 7, 8, 9])
    assert found is not None and found.verdict == registry_pb2.LOOKUP_VERDICT_HIT
    assert found.verified_tokens == 160 and found.prompt_block_tokens == 160
    loc = found.location
    assert loc.engine.kv_port == 5600 and loc.engine_request_id == "r1" and loc.conversation_key == "c1"
    assert list(loc.block_ids[0].ids) == list(range(50, 60)) and loc.epoch == 1 and loc.lease_id == 7


def test_an_edited_history_is_cut_to_the_blocks_before_the_edit() -> None:
    mirror = synced_mirror(entry(TOKENS))
    edited = [*TOKENS[:100], 1, *TOKENS[101:]]  # block 6 (tokens 96..111) differs
    found = lookup(mirror, edited)
    assert found is not None and found.verified_tokens == 96
    assert list(found.location.block_ids[0].ids) == list(range(50, 56))


def test_everything_but_a_usable_hit_is_left_to_the_registry() -> None:
    mirror = synced_mirror(entry(TOKENS), entry(TOKENS, conv="old", expire_s=999))
    assert lookup(mirror, TOKENS, conv="other") is None  # no entry here (the registry may have a newer one)
    assert lookup(mirror, [1, *TOKENS[1:]]) is None  # mismatch from the first block
    assert lookup(mirror, TOKENS, min_tokens=200) is None  # below threshold
    assert lookup(mirror, TOKENS, engines={}) is None  # engine not known to this gateway
    assert lookup(mirror, TOKENS, conv="old") is None  # lease expired by its stored deadline
    assert lookup(mirror, TOKENS, conv="") is None  # content lookups always go to the registry


def test_no_answers_before_the_snapshot_ends_or_once_the_stream_went_quiet() -> None:
    clock = Clock()
    mirror = EntryMirror(max_entries=100, stale_after_s=3.0, clock=clock, wall_clock=lambda: 1_000.0)
    mirror.apply(message((PUT, entry(TOKENS), 10), revision=20))  # first snapshot page
    assert len(mirror) == 1 and not mirror.in_sync() and lookup(mirror, TOKENS) is None
    mirror.apply(message(complete=True, revision=20))
    assert mirror.in_sync() and lookup(mirror, TOKENS) is not None
    clock.now += 3.5  # no message (not even a progress heartbeat) for longer than stale_after_s
    assert not mirror.in_sync() and lookup(mirror, TOKENS) is None
    mirror.apply(message(revision=21))
    assert lookup(mirror, TOKENS) is not None
    mirror.reset()
    assert len(mirror) == 0 and not mirror.in_sync()


def test_events_apply_by_revision_so_late_snapshot_pages_cannot_resurrect_or_roll_back() -> None:
    mirror = synced_mirror(entry(TOKENS, epoch=2, request_id="r2"))  # stored at revision 10
    mirror.apply(message((PUT, entry(TOKENS, epoch=1, request_id="r1"), 9)))  # an older version, replayed
    found = lookup(mirror, TOKENS)
    assert found is not None and found.location.engine_request_id == "r2"
    mirror.apply(message((DELETE, entry(TOKENS), 9)))  # a delete older than what is held
    assert lookup(mirror, TOKENS) is not None
    mirror.apply(message((DELETE, entry(TOKENS), 11)))
    assert len(mirror) == 0 and lookup(mirror, TOKENS) is None
    mirror.apply(message((PUT, entry(TOKENS, epoch=3, request_id="r3"), 12)))
    found = lookup(mirror, TOKENS)
    assert found is not None and found.location.engine_request_id == "r3"


def test_the_copy_is_bounded_and_skips_unusable_entries() -> None:
    mirror = EntryMirror(max_entries=2, stale_after_s=3.0)
    unusable = entry(TOKENS, conv="short")
    unusable.token_count = 3  # less than one block: nothing to verify against
    mirror.apply(
        message(
            *((PUT, entry(TOKENS, conv=f"c{i}"), 10 + i) for i in range(3)),
            (PUT, unusable, 20),
            complete=True,
            revision=20,
        )
    )
    assert len(mirror) == 2 and mirror.skipped == 2
    mirror.apply(message((PUT, entry(TOKENS, conv="c0", epoch=5), 30)))  # a held entry still updates
    assert len(mirror) == 2


def test_an_entry_of_a_previous_engine_incarnation_is_never_answered() -> None:
    old = entry(TOKENS)
    old.engine_incarnation = 41  # made while d0 ran under node lease 41
    mirror = synced_mirror(old)
    before = types_pb2.Engine(engine_id="d0", kv_host="127.0.0.1", kv_port=5600, block_size=BLOCK, node_lease_id=41)
    found = lookup(mirror, TOKENS, engines={"d0": before})
    assert found is not None and found.verdict == registry_pb2.LOOKUP_VERDICT_HIT
    restarted = types_pb2.Engine(
        engine_id="d0", kv_host="127.0.0.1", kv_port=5600, block_size=BLOCK, node_lease_id=42
    )  # a new process under the same id
    assert lookup(mirror, TOKENS, engines={"d0": restarted}) is None


def test_lag_is_the_time_since_the_last_message() -> None:
    clock = Clock()
    mirror = EntryMirror(max_entries=100, stale_after_s=3.0, clock=clock, wall_clock=lambda: 1_000.0)
    assert mirror.lag_s() is None
    mirror.apply(message(complete=True, revision=5))
    clock.now += 1.25
    assert mirror.lag_s() == 1.25 and mirror.in_sync()
    clock.now += 2.0
    assert mirror.lag_s() == 3.25 and not mirror.in_sync()


def test_lag_is_the_age_of_the_data_a_message_brings_when_it_waited_on_the_way() -> None:
    """Issue 30 item 8: a message that arrives now but carries state the registry had 5 s ago (it waited in a
    buffer) is 5 s old; the copy answers no hit from it."""
    clock, wall = Clock(), Clock()
    mirror = EntryMirror(max_entries=100, stale_after_s=3.0, clock=clock, wall_clock=wall)
    stale = message(complete=True, revision=5)
    stale.as_of.FromNanoseconds(int((wall.now - 5.0) * 1e9))
    mirror.apply(stale)
    assert mirror.lag_s() == pytest.approx(5.0) and not mirror.in_sync()
    fresh = message(complete=True, revision=6)
    fresh.as_of.FromNanoseconds(int((wall.now - 0.5) * 1e9))
    mirror.apply(fresh)
    assert mirror.lag_s() == pytest.approx(0.5) and mirror.in_sync()
    # A registry clock ahead of this host's: the time since the message arrived still bounds the lag.
    ahead = message(complete=True, revision=7)
    ahead.as_of.FromNanoseconds(int((wall.now + 60.0) * 1e9))
    mirror.apply(ahead)
    clock.now += 4.0
    wall.now += 4.0
    assert mirror.lag_s() == pytest.approx(4.0) and not mirror.in_sync()


def test_absence_is_vouched_for_only_while_in_sync_and_complete() -> None:
    """``absent`` lets a new conversation's first turn skip tokenizing and the registry: only when the copy
    would have held the entry had the registry had one."""
    clock = Clock()
    mirror = EntryMirror(max_entries=2, stale_after_s=3.0, clock=clock, wall_clock=lambda: 1_000.0)
    mirror.apply(message((PUT, entry(TOKENS, conv="c1"), 10), revision=20))  # the snapshot's first page
    assert not mirror.absent(("acme", "m", "new"))  # not loaded yet
    mirror.apply(message(complete=True, revision=20))
    assert mirror.absent(("acme", "m", "new")) and not mirror.absent(("acme", "m", "c1"))
    clock.now += 3.5  # quiet for longer than stale_after_s
    assert not mirror.absent(("acme", "m", "new"))
    mirror.apply(message((PUT, entry(TOKENS, conv="c2"), 21), revision=21))
    assert mirror.absent(("acme", "m", "new"))
    mirror.apply(message((PUT, entry(TOKENS, conv="c3"), 22), revision=22))  # full: c3 is left out
    assert not mirror.absent(("acme", "m", "c3")) and not mirror.absent(("acme", "m", "new"))
    mirror.apply(message((DELETE, entry(TOKENS, conv="c2"), 23), revision=23))  # room again, c3 still unknown
    assert not mirror.absent(("acme", "m", "c3"))
    mirror.reset()  # the next stream's snapshot starts over
    mirror.apply(message((PUT, entry(TOKENS, conv="c3"), 22), complete=True, revision=23))
    assert mirror.absent(("acme", "m", "new")) and not mirror.absent(("acme", "m", "c3"))
