from __future__ import annotations

import contextlib
from typing import Any

import pytest

from tests.fixtures.common import VLLM_HINT, require

with contextlib.suppress(ImportError):
    # vLLM's first import parses Triton kernels with ast; CPython 3.11.7 can fail that with "AST constructor
    # recursion depth mismatch" (fixed in 3.11.8) when finalizers run during the parse, as after other tests
    # left garbage behind. Import it here, at collection. A missing vLLM still fails the tests through require().
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl  # noqa: F401


@pytest.fixture(scope="module")
def vllm_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Real vLLM configs for the prefill and decode roles (see real_scheduler.py)."""
    require("vllm", VLLM_HINT)
    from .real_scheduler import build_vllm_configs

    return build_vllm_configs(tmp_path_factory.mktemp("config-only-model"))
