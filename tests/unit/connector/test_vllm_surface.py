"""Contract: the vLLM internals kvbridge_connector relies on. Fails loudly when vLLM changes them.

If one of these fails after a vLLM upgrade, re-read the NIXL connector sources and
adapt connector/{connector,scheduler,worker}.py before bumping TESTED_VLLM_VERSIONS.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
nixl_pkg = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
base_worker = pytest.importorskip(f"{nixl_pkg}.base_worker")
pull_worker = pytest.importorskip(f"{nixl_pkg}.pull_worker")
pull_scheduler = pytest.importorskip(f"{nixl_pkg}.pull_scheduler")
base_scheduler = pytest.importorskip(f"{nixl_pkg}.base_scheduler")
nixl_connector = pytest.importorskip(f"{nixl_pkg}.connector")
nixl_metadata = pytest.importorskip(f"{nixl_pkg}.metadata")

from kvbridge_connector.connector import TESTED_VLLM_VERSIONS  # noqa: E402


def params(func: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(func).parameters)


def source(obj: Any) -> str:
    return inspect.getsource(obj)


def test_vllm_version_is_one_we_tested() -> None:
    assert vllm.__version__ in TESTED_VLLM_VERSIONS, (
        f"vLLM {vllm.__version__} is untested with kvbridge_connector (tested: {TESTED_VLLM_VERSIONS})")


def test_connector_construction_surface() -> None:
    base = nixl_connector.NixlBaseConnector
    pull = nixl_connector.NixlPullConnector
    assert issubclass(pull, base)
    assert params(base.__init__) == ["self", "vllm_config", "role", "kv_cache_config"]
    # We skip NixlPullConnector.__init__ and set the two halves ourselves.
    init = source(base.__init__)
    for attribute in ("self.connector_scheduler", "self.connector_worker", "self.engine_id", "self.kv_transfer_config"):
        assert attribute in init
    # Every facade method must forward to these two attributes only.
    assert "self.connector_scheduler.request_finished(request" in source(base)
    assert "self.connector_worker.start_load_kv(self._connector_metadata)" in source(pull.start_load_kv)


def test_block_pool_binding_hook() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched import scheduler

    assert params(KVConnectorBase_V1.bind_gpu_block_pool) == ["self", "gpu_block_pool"]
    assert "self.bind_gpu_block_pool(kv_cache_manager.block_pool)" in source(KVConnectorBase_V1.bind_kv_cache_manager)
    assert "bind_kv_cache_manager(" in source(scheduler.Scheduler)
    assert params(BlockPool.get_num_free_blocks) == ["self"]
    assert "self.num_gpu_blocks" in source(BlockPool.__init__)
    # Holding retained blocks by reference: index blocks by id, add a reference, drop it again.
    assert "self.blocks: list[KVCacheBlock]" in source(BlockPool.__init__)
    assert params(BlockPool.touch) == ["self", "blocks"] and "ref_cnt += 1" in source(BlockPool.touch)
    assert params(BlockPool.free_blocks) == ["self", "ordered_blocks"]
    # A request whose connector does not ask for a delayed free has its blocks freed at once.
    assert "delay_free_blocks" in source(scheduler.Scheduler._free_request)


def test_scheduler_half_surface() -> None:
    cls = pull_scheduler.NixlPullConnectorScheduler
    assert params(cls.__init__) == ["self", "vllm_config", "engine_id", "kv_cache_config"]
    assert params(cls.request_finished) == ["self", "request", "block_ids"]
    assert params(cls.get_num_new_matched_tokens) == ["self", "request", "num_computed_tokens"]
    assert params(cls.build_connector_meta) == ["self", "scheduler_output"]
    assert params(cls.update_connector_output) == ["self", "connector_output"]
    init = source(base_scheduler.NixlBaseConnectorScheduler.__init__)
    for attribute in ("self._reqs_need_send: dict[ReqId, float]", "self.side_channel_host", "self.side_channel_port"):
        assert attribute in init
    finished = source(cls.request_finished)
    assert "self._reqs_need_send[request.request_id]" in finished
    for key in ("remote_block_ids=", "remote_num_tokens=", "remote_blocks_expiry_time="):
        assert key in finished
    # Our one-read-back-per-request guard keys on this flag.
    assert 'params["_remote_blocks_processed"] = True' in source(cls.update_state_after_alloc)
    build = source(base_scheduler.NixlBaseConnectorScheduler.build_connector_meta)
    assert "meta.reqs_to_send = self._reqs_need_send" in build
    assert "self._reqs_need_send = {}" in build


def test_metadata_fields() -> None:
    meta = nixl_metadata.NixlConnectorMetadata()
    assert isinstance(meta.reqs_to_send, dict)
    assert hasattr(meta, "scheduler_clock")
    meta.kvbridge_hold = {"x"}  # plain attributes must be settable (we add two)


def test_worker_half_surface() -> None:
    cls = pull_worker.NixlPullConnectorWorker
    assert params(cls.__init__) == ["self", "vllm_config", "engine_id", "kv_cache_config"]
    assert params(cls.start_load_kv) == ["self", "metadata"]
    assert params(cls._get_new_notifs) == ["self"]
    assert params(cls._reap_expired_send_leases) == ["self", "done_sending"]
    init = source(base_worker.NixlBaseConnectorWorker.__init__)
    assert "self._reqs_to_send: dict[ReqId, float]" in init
    assert "self._reqs_to_process: set[ReqId]" in init
    assert "nixl_agent_config(" in init  # read from the module global at construction
    notifs = source(cls._get_new_notifs)
    assert "self.nixl_wrapper.get_new_notifs()" in notifs  # we filter it for refcount-held requests
    assert "self._reqs_to_send.pop(req_id" in notifs
    assert "self._reqs_to_process.remove(req_id)" in notifs
    # Overwriting a deadline through reqs_to_send must keep working.
    assert "self._reqs_to_send[req_id] = expiration_time" in source(cls.start_load_kv)


def test_nixl_agent_config_has_progress_thread_switch() -> None:
    config = getattr(base_worker, "nixl_agent_config", None)
    if config is None:
        pytest.skip("NIXL not installed")
    assert "enable_prog_thread" in inspect.signature(config).parameters


def test_request_fields() -> None:
    from vllm.v1.request import Request

    init = source(Request.__init__)
    for attribute in ("self.cache_salt", "self.kv_transfer_params", "self.all_token_ids = ConstantList("):
        assert attribute in init
