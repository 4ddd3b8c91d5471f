"""RegistrationBatcher windowing and txn splitting, over the in-process MemoryStore with a minimal handler."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from kvbridge.errors import Unavailable
from kvbridge_services.common.store.base import Compare, Get, KeyValue, Op, Put, TxnResult
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.batcher import BatchJob, BatchLimits, PlannedWrite, RegistrationBatcher


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []  # Gets per read txn
        self.writes: list[int] = []  # Puts per write txn

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (), *, timeout: float = 5.0
    ) -> TxnResult:
        if success and all(isinstance(op, Get) for op in success):
            self.reads.append(len(success))
        else:
            self.writes.append(sum(isinstance(op, Put) for op in success))
        return await super().txn(compares, success, failure, timeout=timeout)


class WriteOnce:
    """Each job writes its key if absent; answers ("ok", revision) or ("exists", value)."""

    def __init__(self) -> None:
        self.alone = 0

    async def decide(
        self, job: BatchJob[tuple[str, Any]], reads: Mapping[bytes, KeyValue | None]
    ) -> tuple[str, Any] | PlannedWrite[tuple[str, Any]]:
        key = job.exclusive_keys[0]
        if (kv := reads[key]) is not None:
            return ("exists", kv.value)
        assert isinstance(job.payload, bytes)
        return PlannedWrite((Compare.absent(key),), (Put(key, job.payload),), lambda rev: ("ok", rev))

    async def commit_alone(
        self, job: BatchJob[tuple[str, Any]], plan: PlannedWrite[tuple[str, Any]]
    ) -> tuple[str, Any]:
        self.alone += 1
        return ("alone", None)


def job(key: str, value: bytes = b"v", shared: str = "shared") -> BatchJob[tuple[str, Any]]:
    return BatchJob(
        exclusive_keys=(key.encode(),), read_keys=(key.encode(), shared.encode()), size_hint=len(value), payload=value
    )


def make(store: CountingStore, **limits: Any) -> tuple[RegistrationBatcher[tuple[str, Any]], WriteOnce]:
    handler = WriteOnce()
    defaults: dict[str, Any] = {
        "window_s": 0.05,
        "max_batch": 64,
        "max_txn_ops": 128,
        "max_txn_bytes": 1 << 20,
        "max_inflight": 1,
    }
    defaults.update(limits)
    return RegistrationBatcher(store, handler, BatchLimits(**defaults), timeout_s=1.0), handler


async def test_one_window_is_one_read_and_one_write_txn() -> None:
    store = CountingStore()
    batcher, handler = make(store)
    answers = await asyncio.gather(*(batcher.submit(job(f"k{i}")) for i in range(20)))
    assert [a[0] for a in answers] == ["ok"] * 20
    assert len({a[1] for a in answers}) == 1  # one txn, one revision
    assert store.reads == [21] and store.writes == [20]  # the shared key is read once
    assert batcher.combined_commits == 1 and handler.alone == 0
    await batcher.close()


async def test_same_exclusive_key_runs_in_a_later_round_in_arrival_order() -> None:
    store = CountingStore()
    batcher, _ = make(store)
    answers = await asyncio.gather(
        batcher.submit(job("k", b"first")), batcher.submit(job("k", b"second")), batcher.submit(job("j"))
    )
    assert answers[0][0] == "ok" and answers[2][0] == "ok"
    assert answers[1] == ("exists", b"first")  # the second saw the first's committed write
    assert len(store.reads) == 2
    await batcher.close()


async def test_txn_op_limit_splits_a_window_into_chunks() -> None:
    store = CountingStore()
    # 8 ops per txn: 7 jobs' keys + the shared key per read txn, 4 jobs' puts (2 per job budgeted) per write.
    batcher, _ = make(store, max_txn_ops=8, max_inflight=1)
    await asyncio.gather(*(batcher.submit(job(f"k{i}")) for i in range(10)))
    assert all(n <= 8 for n in store.reads)
    assert max(store.writes) <= 4 and sum(store.writes) == 10
    await batcher.close()


async def test_byte_limit_splits_into_chunks_of_one_committed_alone() -> None:
    store = CountingStore()
    batcher, handler = make(store, max_txn_bytes=10)
    answers = await asyncio.gather(*(batcher.submit(job(f"k{i}", b"x" * 6)) for i in range(3)))
    assert [a[0] for a in answers] == ["alone"] * 3  # a chunk of one skips the combined txn
    assert store.reads == [2, 2, 2] and handler.alone == 3
    await batcher.close()


async def test_close_answers_queued_jobs_unavailable() -> None:
    store = CountingStore()
    batcher, _ = make(store, window_s=10.0)
    pending = asyncio.ensure_future(batcher.submit(job("k")))
    await asyncio.sleep(0.01)
    await batcher.close()
    with pytest.raises(Unavailable):
        await pending
    with pytest.raises(Unavailable):
        await batcher.submit(job("j"))
