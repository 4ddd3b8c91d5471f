"""Decode-side retention by reference count: vLLM frees the finished request at once (so the engine can go
idle between turns) while the connector's own reference keeps the blocks until the lease ends."""

from __future__ import annotations

import time
from typing import Any

import pytest

from .real_scheduler import FakeRequest, scheduler

pytest.importorskip("vllm")
TOTAL = 64


def _pool() -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=TOTAL, enable_caching=False, hash_block_size=32)


def _finish_retained(sched: Any, pool: Any, request_id: str) -> tuple[bool, list[Any]]:
    """A finished D request of a kvbridge conversation; vLLM then frees what it is told to free."""
    from kvbridge_services.gateway import kvparams

    blocks = pool.get_new_blocks(4)
    params = kvparams.decode_params({"do_remote_prefill": False, "do_remote_decode": False},
                                    tenant="t", conversation_key=f"conv-{request_id}", epoch=1)
    request = FakeRequest(request_id, params, list(range(10, 110)), num_computed_tokens=128,
                          output_token_ids=list(range(300, 340)))
    delay_free, returned = sched.request_finished(request, ([b.block_id for b in blocks],))
    assert returned is not None and returned["kvbridge_retained"] is True
    if not delay_free:
        pool.free_blocks(blocks)  # what vLLM's scheduler does for a request it need not keep
    return delay_free, blocks


def _step(sched: Any) -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return sched.build_connector_meta(SchedulerOutput.make_empty())


GRACE_S = 0.3
EXTRA = {"kvbridge_registry": "127.0.0.1:1", "kvbridge_hash_secret": "unit-hash-secret-0123456789abcdef",
         "kvbridge_model": "tiny", "kvbridge_fallback_ttl_s": 1, "kvbridge_free_grace_s": GRACE_S}


def test_refcount_hold_frees_the_request_but_keeps_its_blocks_until_the_lease_ends(
        vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        pool = _pool()
        sched.bind_block_pool(pool)
        free_before = pool.get_num_free_blocks()
        delay_free, blocks = _finish_retained(sched, pool, "d-1")
        assert not delay_free, "vLLM would keep stepping for a delayed free"
        assert pool.get_num_free_blocks() == free_before - 4 and all(b.ref_cnt == 1 for b in blocks)
        meta = _step(sched)
        assert meta.reqs_to_send == {} and "d-1" in meta.kvbridge_hold
        assert pool.get_num_free_blocks() == free_before - 4  # still held: the lease lives (no news yet)

        sched.retention.bind_lease("d-1", 77)
        sched.retention.lease_ended(77)  # revoked or expired at the lease manager
        meta = _step(sched)
        # Kept for the grace (a prefill sent just before the end may still be reading), then freed.
        assert "d-1" not in meta.kvbridge_release and pool.get_num_free_blocks() == free_before - 4
        time.sleep(GRACE_S)
        meta = _step(sched)
        assert "d-1" in meta.kvbridge_release
        assert pool.get_num_free_blocks() == free_before and all(b.ref_cnt == 0 for b in blocks)


def test_refcount_hold_ends_at_the_fallback_deadline_without_the_control_plane(
        vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        pool = _pool()
        sched.bind_block_pool(pool)
        free_before = pool.get_num_free_blocks()
        _finish_retained(sched, pool, "d-2")
        entry = sched.retention.get("d-2")
        entry.hold_deadline = 0.0  # nobody confirmed the lease for a whole fallback TTL
        _step(sched)
        assert pool.get_num_free_blocks() == free_before
        assert "d-2" not in sched.retention


def test_delayed_free_remains_available(vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_consumer", dict(EXTRA, kvbridge_hold_blocks="delayed_free")) as sched:
        pool = _pool()
        sched.bind_block_pool(pool)
        delay_free, _ = _finish_retained(sched, pool, "d-3")
        assert delay_free
        assert "d-3" in _step(sched).reqs_to_send


def test_hold_mode_is_validated() -> None:
    from kvbridge_connector.settings import ConnectorSettings

    with pytest.raises(ValueError, match="kvbridge_hold_blocks"):
        ConnectorSettings.from_extra_config({"kvbridge_hold_blocks": "forever"})
