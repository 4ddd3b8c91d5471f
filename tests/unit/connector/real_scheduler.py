"""Real ``KvbridgeConnectorScheduler`` instances for unit tests: a real vLLM config (config.json only,
no weights, no tokenizer) and minimal stand-ins for ``vllm.v1.request.Request``."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge_connector.settings import ConnectorSettings
from tests.fixtures.common import VLLM_HINT, require

torch = require("torch", VLLM_HINT)

BLOCK = 32


@dataclass
class FakeRequest:
    """The fields of vllm.v1.request.Request the connector's scheduler half reads."""

    request_id: str
    kv_transfer_params: dict[str, Any]
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    trace_headers: dict[str, str] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Any = None
    max_tokens: int = 16
    # Unix time P's API server received it (vLLM sets it on arrival).
    arrival_time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        from vllm.v1.request import RequestStatus

        self.status = self.status or RequestStatus.FINISHED_STOPPED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def _vllm_config(model_dir: Path, role: str) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        kv_connector="KvbridgeConnector",
        kv_role=role,  # type: ignore[arg-type]
        kv_buffer_device="cpu",
        kv_connector_module_path="kvbridge_connector.connector",
        engine_id=role,
        kv_connector_extra_config={"bidirectional_kv_xfer": True},
    )
    return EngineArgs(
        model=str(model_dir),
        served_model_name=["tiny"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=1024,
        dtype="float32",
        kv_transfer_config=transfer,
    ).create_engine_config()


def build_vllm_configs(model_dir: Path) -> dict[str, Any]:
    """Real vLLM configs for a 2-layer Llama shape (config.json only: no weights, no tokenizer needed)."""
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 512,
                "max_position_embeddings": 1024,
                "torch_dtype": "float32",
                "rms_norm_eps": 1e-5,
            }
        )
    )
    return {role: _vllm_config(model_dir, role) for role in ("kv_producer", "kv_consumer")}


def kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )


BYTES_PER_TOKEN = 2 * 2 * 16 * 4 * 2  # K+V x heads x head size x float32 x layers
ENGINE_IDS = {"kv_producer": "prefill-0", "kv_consumer": "decode-0"}


@contextlib.contextmanager
def scheduler(vllm_configs: dict[str, Any], role: str, extra: dict[str, Any]) -> Iterator[Any]:
    from kvbridge_connector.scheduler import KvbridgeConnectorScheduler

    settings = ConnectorSettings.from_extra_config(extra, env={})
    sched = KvbridgeConnectorScheduler(vllm_configs[role], ENGINE_IDS[role], kv_cache_config(), settings)
    try:
        yield sched
    finally:
        sched.shutdown()
