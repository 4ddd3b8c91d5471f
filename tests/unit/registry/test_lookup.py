"""What an indexed entry answers a prompt, how deep a content lookup searches, which content match wins."""

from __future__ import annotations

import math

import pytest

from kvbridge import hashchain
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.entrylookup import record_of
from kvbridge_services.common.hashrecord import HashRecord
from kvbridge_services.registry.index import IndexedEntry
from kvbridge_services.registry.lookup import Refused, deepest_checkpoint, keyed_match, outranks

S = b"0123456789abcdef"
TOKENS = list(range(40))  # ten blocks of 4
ENGINE = types_pb2.Engine(engine_id="d0", model="m", block_size=4, node_lease_id=100)
NOW = 1_000.0


def chain(tokens: list[int]) -> list[bytes]:
    return hashchain.chain(S, "acme", "m", "", 4, tokens)


def indexed(tokens: list[int] = TOKENS, *, conv: str = "c", registered_s: int = 10) -> IndexedEntry:
    rec = HashRecord.from_chain(chain(tokens), 4)
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model="m", conversation_key=conv),
        engine_id="d0",
        block_ids=[types_pb2.BlockIds(ids=list(range(len(tokens) // 4)))],
        block_size=4,
        token_count=len(tokens),
        block_hashes=rec.checkpoints,
        chain_stride=4,
        final_block_hash=rec.final,
        lease_id=7,
        epoch=1,
        engine_incarnation=100,
    )
    entry.register_time.FromSeconds(registered_s)
    return IndexedEntry(("acme", "m", conv), entry, record_of(entry), 1)


def test_an_entry_verifies_the_blocks_the_prompt_shares_with_it() -> None:
    assert keyed_match(indexed(), ENGINE, 4, chain([*TOKENS, 1, 2, 3, 4]), NOW) == 10
    assert keyed_match(indexed(), ENGINE, 4, chain(TOKENS[:24]), NOW) == 4  # the last checkpoint reached


def test_an_entry_sharing_no_verified_block_is_a_mismatch() -> None:
    other_prompt = chain([t + 1 for t in TOKENS])
    assert keyed_match(indexed(), ENGINE, 4, other_prompt, NOW) == Refused(registry_pb2.LOOKUP_VERDICT_MISMATCH)


def expired() -> IndexedEntry:
    item = indexed()
    item.entry.expire_time.FromSeconds(int(NOW))
    return item


@pytest.mark.parametrize(
    ("item", "engine", "block_size", "verdict"),
    [
        (indexed(), None, 4, registry_pb2.LOOKUP_VERDICT_ENGINE_GONE),
        (
            indexed(),
            types_pb2.Engine(engine_id="d0", node_lease_id=101),
            4,
            registry_pb2.LOOKUP_VERDICT_ENGINE_RESTARTED,
        ),
        (indexed(), ENGINE, 8, registry_pb2.LOOKUP_VERDICT_BLOCK_SIZE_MISMATCH),
        (expired(), ENGINE, 4, registry_pb2.LOOKUP_VERDICT_EXPIRED),
    ],
)
def test_an_unusable_entry_is_refused_before_its_hashes_are_compared(
    item: IndexedEntry,
    engine: types_pb2.Engine | None,
    block_size: int,
    verdict: registry_pb2.LookupVerdict.ValueType,
) -> None:
    # The prompt matches the entry: only the entry's state refuses it.
    assert keyed_match(item, engine, block_size, chain(TOKENS), NOW) == Refused(verdict)


PROMPT = [bytes([i]) for i in range(10)]  # five checkpoints of stride 2: blocks 1, 3, 5, 7, 9


@pytest.mark.parametrize(("held_checkpoints", "depth"), [(0, 0), (1, 1), (3, 3), (5, 5)])
def test_the_deepest_held_checkpoint_is_found(held_checkpoints: int, depth: int) -> None:
    held = {PROMPT[j * 2 - 1] for j in range(1, held_checkpoints + 1)}
    assert deepest_checkpoint(PROMPT, 2, held.__contains__) == depth


def test_a_partial_last_checkpoint_is_not_searched() -> None:
    assert deepest_checkpoint(PROMPT[:9], 2, lambda h: True) == 4  # block 9 is not in the prompt


def test_the_search_asks_logarithmically_many_times() -> None:
    prompt = [i.to_bytes(2, "big") for i in range(4096)]
    held = set(prompt)
    asked: list[bytes] = []

    def holds(h: bytes) -> bool:
        asked.append(h)
        return h in held

    assert deepest_checkpoint(prompt, 16, holds) == 256  # every checkpoint the prompt has
    held = set(prompt[: 16 * 100])
    asked.clear()
    assert deepest_checkpoint(prompt, 16, holds) == 100
    assert len(asked) <= math.ceil(math.log2(256)) + 1


def test_a_content_match_outranks_by_blocks_then_by_later_registration() -> None:
    older, newer = indexed(conv="a", registered_s=10), indexed(conv="b", registered_s=20)
    assert not outranks(newer, 0, None)  # nothing verified never wins
    assert outranks(older, 1, None)
    assert outranks(older, 5, (newer, 4))
    assert not outranks(newer, 4, (older, 5))
    assert outranks(newer, 5, (older, 5))
    assert not outranks(older, 5, (newer, 5))
    assert not outranks(older, 5, (indexed(conv="c", registered_s=10), 5))  # a tie keeps the first found
