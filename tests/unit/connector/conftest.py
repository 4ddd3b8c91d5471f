from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.common import VLLM_HINT, require


@pytest.fixture(scope="module")
def vllm_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Real vLLM configs for the prefill and decode roles (see real_scheduler.py)."""
    require("vllm", VLLM_HINT)
    from .real_scheduler import build_vllm_configs

    return build_vllm_configs(tmp_path_factory.mktemp("config-only-model"))
