"""What the gateway registers for a stock engine given by URL: configured fields, else what the engine states; every
field neither gives is named in one line (discovery.py, ADR 0027)."""

from __future__ import annotations

import pytest

from kvbridge_services.gateway.config import StaticEngine
from kvbridge_services.gateway.discovery import (
    Identity,
    Statement,
    Undiscoverable,
    block_sizes,
    resolve,
    served_models,
)

URL = "http://p:8000"
ENV = "KVBRIDGE_GATEWAY_PREFILL_ENGINES"
# What vLLM 0.32's /metrics says (v1/metrics/loggers.py: every CacheConfig field as a label, then the engine index).
VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",gpu_memory_utilization="0.9",is_attention_free="False",kv_sharing_fast_prefill="False",\
mamba_cache_dtype="auto",num_gpu_blocks="1234",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",\
sliding_window="None",swap_space="4",note="a \\"quoted\\" value",engine="0"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1]],
    "remote_engine_id": "3f2a-engine",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
}
STATED = Statement(models=("m",), block_sizes=frozenset({32}), params=PARAMS)


def spec(**fields: object) -> StaticEngine:
    return StaticEngine.model_validate({"url": URL, **fields})


def refused(spec_: StaticEngine, said: Statement) -> str:
    with pytest.raises(Undiscoverable) as failed:
        resolve(spec_, "prefill", said, env=ENV)
    return str(failed.value)


def test_block_size_is_read_from_vllms_cache_config_info() -> None:
    assert block_sizes(VLLM_METRICS) == frozenset({32})
    two_cores = VLLM_METRICS + 'vllm:cache_config_info{block_size="16",engine="1"} 1.0\n'
    assert block_sizes(two_cores) == frozenset({16, 32})
    assert block_sizes('vllm:kv_cache_usage_perc{engine="0"} 0.5\n') == frozenset()
    assert block_sizes('vllm:cache_config_info{block_size="None",engine="0"} 1.0\n') == frozenset()


def test_served_models_leave_lora_adapters_out() -> None:
    cards = {"data": [{"id": "m", "parent": None}, {"id": "m-lora", "parent": "m"}, {"id": 7}]}
    assert served_models(cards) == ("m",)
    assert served_models({"data": "nope"}) == ()


def test_a_url_alone_takes_everything_from_the_engine() -> None:
    got = resolve(spec(), "prefill", STATED, env=ENV)
    assert got == Identity(
        "3f2a-engine", "m", "10.0.0.7", 5600, 32, frozenset({"model", "block_size", "engine_id", "kv_host", "kv_port"})
    )
    assert got.probed


def test_configured_fields_are_kept_and_host_and_port_win_over_the_stated_ones() -> None:
    got = resolve(spec(model="m", kv_host="p.internal", kv_port=7000), "prefill", STATED, env=ENV)
    assert (got.engine_id, got.kv_host, got.kv_port, got.stated) == (
        "3f2a-engine",
        "p.internal",
        7000,
        frozenset({"block_size", "engine_id"}),
    )
    configured = spec(model="m", engine_id="p0", kv_host="h", kv_port=1, block_size=32)
    assert not resolve(configured, "prefill", Statement(), env=ENV).probed  # nothing asked: nothing stated


def test_a_block_size_nobody_states_is_never_guessed() -> None:
    message = refused(spec(), Statement(models=("m",), block_sizes=frozenset(), params=PARAMS))
    assert message.startswith(f"engine {URL} (prefill) cannot be registered for reuse: block_size not stated")
    assert "vllm:cache_config_info" in message and ENV in message and '"block_size": ...' in message
    assert "\n" not in message
    # The operator's word stands where the engine says nothing, never against what it says.
    assert resolve(spec(block_size=16), "prefill", Statement(("m",), frozenset(), PARAMS), env=ENV).block_size == 16
    assert "configured 16, the engine states 32" in refused(spec(block_size=16), STATED)
    assert "block sizes [16, 32]" in refused(spec(), Statement(("m",), frozenset({16, 32}), PARAMS))


def test_an_engine_without_a_kv_connector_names_the_identity_fields() -> None:
    message = refused(spec(), Statement(models=("m",), block_sizes=frozenset({32}), params=None))
    assert ": engine_id, kv_host, kv_port not stated by the engine" in message
    assert "--kv-transfer-config" in message
    probe_refused = Statement(("m",), frozenset({32}), None, "it refused the identity probe (400: bad)")
    assert "it refused the identity probe" in refused(spec(), probe_refused)
    assert "engine_id configured 'p0', the engine states '3f2a-engine'" in refused(spec(engine_id="p0"), STATED)


def test_a_model_the_engine_does_not_name_alone_must_be_configured() -> None:
    assert ": model not stated" in refused(spec(), Statement(("a", "b"), frozenset({32}), PARAMS))
    assert "it serves a, b, not 'c'" in refused(spec(model="c"), Statement(("a", "b"), frozenset({32}), PARAMS))
    assert resolve(spec(model="b"), "prefill", Statement(("a", "b"), frozenset({32}), PARAMS), env=ENV).model == "b"
