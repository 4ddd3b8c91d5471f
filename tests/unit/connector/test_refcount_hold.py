"""Decode-side retention by reference count: vLLM frees the finished request at once (so the engine can go
idle between turns) while the connector's own reference keeps the blocks until the lease ends."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.fixtures.common import VLLM_HINT, require

from .real_scheduler import FakeRequest, scheduler

require("vllm", VLLM_HINT)
TOTAL = 64


def _pool() -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=TOTAL, enable_caching=False, hash_block_size=32)


def _finish_retained(sched: Any, pool: Any, request_id: str) -> tuple[bool, list[Any]]:
    """A finished D request of a kvbridge conversation; vLLM then frees what it is told to free."""
    from kvbridge_services.gateway import kvparams

    blocks = pool.get_new_blocks(4)
    params = kvparams.decode_params(
        {"do_remote_prefill": False, "do_remote_decode": False},
        tenant="t",
        conversation_key=f"conv-{request_id}",
        epoch=1,
        secret=bytes.fromhex(SECRET_HEX),
    )
    request = FakeRequest(
        request_id, params, list(range(10, 110)), num_computed_tokens=128, output_token_ids=list(range(300, 340))
    )
    delay_free, returned = sched.request_finished(request, ([b.block_id for b in blocks],))
    assert returned is not None and returned["kvbridge_retained"] is True
    if not delay_free:
        pool.free_blocks(blocks)  # what vLLM's scheduler does for a request it need not keep
    return delay_free, blocks


class _QuietControlPlane:
    """Stands in for the control plane thread: records commands, emits no events (the tests play them)."""

    def __init__(self) -> None:
        self.commands: list[Any] = []

    def submit(self, command: Any) -> bool:
        self.commands.append(command)
        return True

    def drain(self, limit: int = 1024) -> list[Any]:
        return []

    def stop(self, timeout_s: float = 2.0) -> None:
        pass


def _quiet(sched: Any) -> Any:
    sched.control_plane.stop()
    sched.control_plane = _QuietControlPlane()
    return sched


def _step(sched: Any) -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return sched.build_connector_meta(SchedulerOutput.make_empty())


DEMAND_WINDOW_S = 1.3  # past a 1.25 s demand window
GRACE_S = 1.2  # the least a 0.1 s offer window and a 0.05 s index lag bound allow (+ 1 s for the READ)
SECRET_HEX = b"unit-hash-secret-0123456789abcdef".hex()  # the deployment secret is hex (kvbridge.secret)
EXTRA = {
    "kvbridge_registry": "127.0.0.1:1",
    "kvbridge_hash_secret": SECRET_HEX,
    "kvbridge_model": "tiny",
    "kvbridge_offer_window_s": 0.1,
    "kvbridge_index_max_lag_s": 0.05,
    "kvbridge_node_lease_ttl_s": 1,
    "kvbridge_fallback_ttl_s": 3,
    "kvbridge_free_grace_s": GRACE_S,
}


def test_refcount_hold_frees_the_request_but_keeps_its_blocks_until_the_lease_ends(
    vllm_configs: dict[str, Any],
) -> None:
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        _quiet(sched)
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


def test_refcount_hold_ends_at_the_fallback_deadline_without_the_control_plane(vllm_configs: dict[str, Any]) -> None:
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        _quiet(sched)
        pool = _pool()
        sched.bind_block_pool(pool)
        free_before = pool.get_num_free_blocks()
        _finish_retained(sched, pool, "d-2")
        entry = sched.retention.get("d-2")
        entry.hold_deadline = 0.0  # nobody confirmed the lease for a whole fallback TTL
        _step(sched)
        assert pool.get_num_free_blocks() == free_before
        assert "d-2" not in sched.retention


def test_a_read_notification_after_the_release_never_reaches_vllms_scheduler(vllm_configs: dict[str, Any]) -> None:
    """The decode engine died under memory pressure (issue 14): a prefill's late read notification for a
    released refcount-held request came back as "finished sending" for a request vLLM had already freed."""
    from vllm.v1.outputs import KVConnectorOutput

    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        _quiet(sched)
        pool = _pool()
        sched.bind_block_pool(pool)
        _finish_retained(sched, pool, "d-4")
        _step(sched)
        sched.retention.bind_lease("d-4", 78)
        sched.retention.lease_ended(78)
        time.sleep(GRACE_S)
        assert "d-4" in _step(sched).kvbridge_release
        output = KVConnectorOutput(finished_sending={"d-4", "other"}, finished_recving=set())
        sched.update_connector_output(output)
        assert output.finished_sending == {"other"}


def test_memory_pressure_withdraws_first_and_frees_only_after_the_confirmed_end_and_the_grace(
    vllm_configs: dict[str, Any],
) -> None:
    """A READ is one-sided: under pressure D revokes the lease (no new offers), then frees once the end is
    confirmed and the offer window (+ index lag) has passed; never at once."""
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        _quiet(sched)
        pool = _pool()
        sched.bind_block_pool(pool)
        free_before = pool.get_num_free_blocks()
        _finish_retained(sched, pool, "d-5")  # retained from slack: 60 of 64 blocks stay free
        _step(sched)
        sched.retention.bind_lease("d-5", 79)
        live = pool.get_new_blocks(50)  # running requests take the cache: 10 free, below the 20 % headroom
        decisions_meta = _step(sched)  # withdraw
        entry = sched.retention.get("d-5")
        assert entry is not None and entry.released and "d-5" not in decisions_meta.kvbridge_release
        revokes = [c for c in sched.control_plane.commands if type(c).__name__ == "RevokeLease"]
        assert [(c.lease_id, c.reason) for c in revokes] == [(79, "REVOKE_REASON_EVICTED_MEMORY_PRESSURE")]
        time.sleep(GRACE_S)
        _step(sched)
        assert pool.get_num_free_blocks() == free_before - 54, "freed before the revoke was confirmed"
        sched.retention.lease_ended(79)  # the lease manager acknowledged the revoke
        _step(sched)
        assert pool.get_num_free_blocks() == free_before - 54, "freed within the grace"
        time.sleep(GRACE_S)
        _step(sched)
        assert pool.get_num_free_blocks() == free_before - 50
        pool.free_blocks(live)


def _finish(sched: Any, pool: Any, request_id: str) -> tuple[bool, dict[str, Any] | None, list[Any]]:
    from kvbridge_services.gateway import kvparams

    blocks = pool.get_new_blocks(4)
    params = kvparams.decode_params(
        {"do_remote_prefill": False, "do_remote_decode": False},
        tenant="t",
        conversation_key=f"conv-{request_id}",
        epoch=1,
        secret=bytes.fromhex(SECRET_HEX),
    )
    request = FakeRequest(
        request_id, params, list(range(10, 110)), num_computed_tokens=128, output_token_ids=list(range(300, 340))
    )
    delay_free, returned = sched.request_finished(request, ([b.block_id for b in blocks],))
    if not delay_free and (returned is None or not returned.get("kvbridge_retained")):
        pool.free_blocks(blocks)  # vLLM frees a request the connector does not keep
    return delay_free, returned, blocks


def test_a_finished_request_is_not_retained_while_a_request_waits_for_blocks(vllm_configs: dict[str, Any]) -> None:
    """Retained KV is a cache (ADR 0026): when vLLM could not admit a request for want of blocks, a finished
    request's blocks go to it at once: never registered, never offered, so no grace."""
    extra = dict(EXTRA, kvbridge_rpc_deadline_s=0.05, kvbridge_demand_window_s=1)  # window: grace + RPC = 1.25 s
    with scheduler(vllm_configs, "kv_consumer", extra) as sched:
        _quiet(sched)
        pool = _pool()
        sched.bind_block_pool(pool)
        live = pool.get_new_blocks(40)  # 23 free (and vLLM's null block)
        # vLLM asks about a waiting 28-block request (800 prompt + 96 new tokens) and cannot allocate it.
        waiting = FakeRequest("w-1", {}, list(range(800)), max_tokens=96)
        sched.get_num_new_matched_tokens(waiting, 0)
        _step(sched)
        delay_free, returned, blocks = _finish(sched, pool, "d-6")
        assert (delay_free, returned) == (False, None)
        assert "d-6" not in sched.retention and all(b.ref_cnt == 0 for b in blocks)
        assert not [c for c in sched.control_plane.commands if type(c).__name__ == "RegisterEntry"]
        # Admitted (vLLM allocated it) and done: nothing waits any more, but live demand reached 40 + 28 blocks
        # within the demand window, so the headroom keeps 28 free beyond the 40 running: still no retention.
        sched.get_num_new_matched_tokens(waiting, 0)
        sched.update_state_after_alloc(waiting, None, 0)
        _step(sched)
        assert _finish(sched, pool, "d-7")[1] is None
        time.sleep(DEMAND_WINDOW_S)  # the peak leaves the window: the next finished request is retained
        _step(sched)
        _, returned, _ = _finish(sched, pool, "d-8")
        assert returned is not None and returned["kvbridge_retained"] is True and "d-8" in sched.retention
        pool.free_blocks(live)


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


def test_a_waiting_request_asks_only_for_blocks_beyond_its_local_prefix_hit(vllm_configs: dict[str, Any]) -> None:
    """The next turn of a retained conversation shares the retained blocks (vLLM's prefix cache): only the rest
    is demand, so retaining it did not cost the waiting request anything."""
    with scheduler(vllm_configs, "kv_consumer", EXTRA) as sched:
        _quiet(sched)
        pool = _pool()
        sched.bind_block_pool(pool)
        live = pool.get_new_blocks(40)  # 23 free
        # 800 prompt + 96 new tokens = 28 blocks, 640 tokens (20 blocks) of them in the local prefix cache: 8.
        waiting = FakeRequest("w-2", {}, list(range(800)), max_tokens=96)
        sched.get_num_new_matched_tokens(waiting, 640)
        _step(sched)
        _, returned, _ = _finish(sched, pool, "d-9")
        assert returned is not None and returned["kvbridge_retained"] is True
        pool.free_blocks(live)
