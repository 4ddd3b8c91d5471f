"""Real vLLM engines (1 prefill + 1 decode, NIXL over loopback) for e2e tests: CPU, or GPU when set (docs/gpu.md).

Engines start once per configuration per session (an ``EnginePool`` keeps one
pair alive, this machine fits no more) and are stopped at session end. Logs:
``<basetemp>/vllm-logs/<config>/{prefill,decode}.log``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.pd_client import E2E_SECRET
from tests.fixtures.common import VLLM_HINT, require, require_etcd_binary
from tests.fixtures.control_plane_procs import ControlPlaneProcs, run_control_plane
from tests.fixtures.tiny_model import model_dir_for_engines
from tests.fixtures.vllm_engines import EnginePool, PDEngines


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engines' model: KVBRIDGE_ENGINE_MODEL when set (GPU mode, docs/gpu.md), else the tiny one built here."""
    return model_dir_for_engines(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def engine_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    require("vllm", VLLM_HINT)
    require("nixl._api", VLLM_HINT)
    log_root = tmp_path_factory.mktemp("vllm-logs")
    pool = EnginePool(tiny_model_dir, log_root)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def pd_engines(engine_pool: EnginePool) -> PDEngines:
    """Stock NixlConnector on both engines (bidirectional, recompute on P)."""
    return engine_pool.get("stock")


HASH_SECRET = E2E_SECRET.hex()  # the deployment secret is hex (kvbridge.secret)
# Short TTLs so lease behaviour shows within a test: stock D would free after OLD_TTL_S.
OLD_TTL_S = 10
ENTRY_LEASE_TTL_S = 15
# D's node lease and its hold without a confirmed lease (at least node lease TTL + free grace, 10 s).
NODE_LEASE_TTL_S = 5
FALLBACK_TTL_S = 15


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcs]:
    """etcd + registry + lease manager processes, shared by the session."""
    require_etcd_binary()
    with run_control_plane(tmp_path_factory.mktemp("control-plane")) as procs:
        yield procs


def kvbridge_overrides(procs: ControlPlaneProcs, **extra: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """EngineSpec overrides: the kvbridge connector on P and D, both registered with the control plane (with
    their HTTP address: the launcher adds it, so a gateway can route to them from the registry's engine list)."""
    # NIXL progress thread stays on: without it an idle engine never progresses UCX TCP, so a
    # peer's READ hung here (engines only poll NIXL while they have requests).
    common: dict[str, Any] = {
        "kvbridge_registry": procs.registry_target,
        "kvbridge_lease": procs.lease_target,
        "kvbridge_hash_secret": HASH_SECRET,
        "kvbridge_model": "tiny",
    }
    decode_extra = dict(
        common,
        decoder_kv_blocks_ttl=OLD_TTL_S,
        kvbridge_fallback_ttl_s=FALLBACK_TTL_S,
        kvbridge_node_lease_ttl_s=NODE_LEASE_TTL_S,
        kvbridge_entry_lease_ttl_s=ENTRY_LEASE_TTL_S,
        **extra,
    )
    connector = {
        "kv_connector": "KvbridgeConnector",
        "kv_connector_module_path": "kvbridge_connector.connector",
        # What a deployment serving tool-calling agents runs with: vLLM refuses `tools` (tool_choice "auto", the
        # default) without a parser. "pythonic" needs no special tokens, which the tiny model's tokenizer lacks.
        "extra_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"],
    }
    return dict(connector, extra_config=common), dict(connector, extra_config=decode_extra)


@pytest.fixture
def kvbridge_pd(engine_pool: EnginePool, request: pytest.FixtureRequest) -> PDEngines:
    """kvbridge engines, registered with the control plane. Other engines are stopped BEFORE the control
    plane starts: engines spin both cores, and a control plane started beside them took minutes."""
    if not engine_pool.holds("kvbridge"):
        engine_pool.close()
    control_plane: ControlPlaneProcs = request.getfixturevalue("control_plane")
    prefill, decode = kvbridge_overrides(control_plane)
    return engine_pool.get("kvbridge", prefill, decode)
