"""The dev-engine launcher's CPU and GPU modes: the exact command and environment each engine gets, and the
settings' validation (no vLLM started: engine_command / engine_env are what start_engine runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_services.devengines.launcher import (
    CPU_MODE,
    Engine,
    EngineMode,
    EngineModeError,
    engine_command,
    engine_env,
    engine_mode_from_env,
    free_port,
    kvbridge_connector_overrides,
    pd_specs,
    place_worker_threads,
    with_http_url,
)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    return path


def gpu_env(model: Path, **settings: str) -> dict[str, str]:
    return {"KVBRIDGE_ENGINE_DEVICE": "cuda", "KVBRIDGE_ENGINE_MODEL": str(model), **settings}


def transfer_config(command: list[str]) -> dict[str, object]:
    parsed: dict[str, object] = json.loads(command[command.index("--kv-transfer-config") + 1])
    return parsed


def test_no_settings_is_the_cpu_mode() -> None:
    assert engine_mode_from_env({}) == CPU_MODE
    assert engine_mode_from_env({"KVBRIDGE_ENGINE_DEVICE": "CPU"}) == CPU_MODE
    assert (CPU_MODE.device, CPU_MODE.block_size, CPU_MODE.dtype, CPU_MODE.model) == ("cpu", 32, "float32", None)


def test_cpu_command_and_env_are_the_cpu_launcher_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    prefill, decode = pd_specs(Path("/m"), tmp_path, mode=engine_mode_from_env({}))
    assert engine_command(prefill, 8100, "p-1") == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer",
                "kv_buffer_device": "cpu",
                "engine_id": "p-1",
                "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
                "kv_load_failure_policy": "recompute",
            }
        ),
        "--no-enable-prefix-caching",
    ]
    env = engine_env(decode, 5700)
    assert {
        key: env[key]
        for key in (
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_NIXL_SIDE_CHANNEL_PORT",
            "UCX_TLS",
            "UCX_NET_DEVICES",
        )
    } == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(decode.cpu_core),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700",
        "UCX_TLS": "tcp,self,sm",
        "UCX_NET_DEVICES": "lo",
    }
    assert "--gpu-memory-utilization" not in engine_command(decode, 8200, "d-1")


def test_gpu_mode_gives_each_engine_its_gpu_memory_share_block_16_and_a_cuda_kv_buffer(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")  # inherited from the operator's shell: must not pass
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    mode = engine_mode_from_env(
        gpu_env(model, KVBRIDGE_PREFILL_GPUS="2", KVBRIDGE_DECODE_GPUS="3", KVBRIDGE_ENGINE_DTYPE="bfloat16")
    )
    assert mode == EngineMode("cuda", model, "2", "3", 0.85, "bfloat16", 16)
    prefill, decode = pd_specs(mode.model or model, tmp_path, mode=mode)
    for spec, gpu, port in ((prefill, "2", 8100), (decode, "3", 8200)):
        command = engine_command(spec, port, f"{spec.name}-1")
        flags = dict(zip(command[3::2], command[4::2], strict=False))
        assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        assert command[command.index("--model") + 1] == str(model)
        assert command[command.index("--block-size") + 1] == "16"
        assert command[command.index("--dtype") + 1] == "bfloat16"
        assert command[command.index("--gpu-memory-utilization") + 1] == "0.85"
        assert transfer_config(command)["kv_buffer_device"] == "cuda"
        assert flags["--served-model-name"] == "tiny"
        env = engine_env(spec, 5600)
        assert env["CUDA_VISIBLE_DEVICES"] == gpu
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert not [key for key in env if key.startswith("VLLM_CPU_")]
        assert "UCX_TLS" not in env and "UCX_NET_DEVICES" not in env  # UCX picks its CUDA transports
    assert "--no-enable-prefix-caching" in engine_command(prefill, 8100, "p")
    assert "--no-enable-prefix-caching" not in engine_command(decode, 8200, "d")


def test_one_gpu_for_both_engines_splits_its_memory(model: Path, tmp_path: Path) -> None:
    mode = engine_mode_from_env(gpu_env(model, KVBRIDGE_PREFILL_GPUS="0", KVBRIDGE_DECODE_GPUS="0"))
    assert (mode.prefill_gpus, mode.decode_gpus, mode.gpu_memory_utilization) == ("0", "0", 0.4)
    assert (
        engine_mode_from_env(
            gpu_env(model, KVBRIDGE_DECODE_GPUS="0", KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION="0.45")
        ).gpu_memory_utilization
        == 0.45
    )
    defaults = engine_mode_from_env(gpu_env(model))
    assert (defaults.prefill_gpus, defaults.decode_gpus, defaults.dtype) == ("0", "1", "auto")


def test_overrides_apply_after_the_mode(model: Path, tmp_path: Path) -> None:
    mode = engine_mode_from_env(gpu_env(model))
    prefill, _ = pd_specs(
        model, tmp_path, mode=mode, prefill_overrides={"gpu_memory_utilization": 0.5, "max_model_len": 4096}
    )
    command = engine_command(prefill, 8100, "p")
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.5"
    assert command[command.index("--max-model-len") + 1] == "4096"


def test_a_gpu_engine_is_not_pinned_to_a_core(model: Path, tmp_path: Path) -> None:
    prefill, _ = pd_specs(model, tmp_path, mode=engine_mode_from_env(gpu_env(model)))
    process = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    process.wait(timeout=30)
    engine = Engine(prefill, 8100, 5600, "p", process, tmp_path / "p.log")
    assert place_worker_threads(engine) == "none (GPU engine: no core pinning)"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"KVBRIDGE_ENGINE_DEVICE": "rocm"}, r"KVBRIDGE_ENGINE_DEVICE='rocm': must be cpu or cuda"),
        ({"KVBRIDGE_ENGINE_DEVICE": "cuda"}, r"KVBRIDGE_ENGINE_DEVICE=cuda needs KVBRIDGE_ENGINE_MODEL"),
        ({"KVBRIDGE_PREFILL_GPUS": "0"}, r"KVBRIDGE_PREFILL_GPUS set but KVBRIDGE_ENGINE_DEVICE is not cuda"),
        (
            {"KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION": "0.4", "KVBRIDGE_ENGINE_DTYPE": "auto"},
            r"KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION, KVBRIDGE_ENGINE_DTYPE set but KVBRIDGE_ENGINE_DEVICE is not cuda",
        ),
    ],
)
def test_invalid_settings_without_a_model_are_refused_by_name(settings: dict[str, str], message: str) -> None:
    with pytest.raises(EngineModeError, match=message):
        engine_mode_from_env(settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"KVBRIDGE_PREFILL_GPUS": "0,1"}, r"KVBRIDGE_PREFILL_GPUS='0,1': give one GPU index"),
        ({"KVBRIDGE_DECODE_GPUS": "gpu1"}, r"KVBRIDGE_DECODE_GPUS='gpu1': give one GPU index"),
        ({"KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION": "1.2"}, r"MEMORY_UTILIZATION='1.2': a fraction in \(0, 1\)"),
        ({"KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION": "lots"}, r"MEMORY_UTILIZATION='lots': a fraction in \(0, 1\)"),
        (
            {"KVBRIDGE_DECODE_GPUS": "0", "KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION": "0.6"},
            r"both GPU 0: .*KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION=0.6 \(each\) must be <= 0.475",
        ),
        ({"KVBRIDGE_ENGINE_DTYPE": "fp8"}, r"KVBRIDGE_ENGINE_DTYPE='fp8': one of auto, bfloat16, float16, float32"),
    ],
)
def test_invalid_gpu_settings_are_refused_by_name(model: Path, settings: dict[str, str], message: str) -> None:
    with pytest.raises(EngineModeError, match=message):
        engine_mode_from_env(gpu_env(model, **settings))


def test_the_model_must_be_a_local_model_dir_with_a_vocabulary_the_tests_fit(tmp_path: Path, model: Path) -> None:
    with pytest.raises(EngineModeError, match=r"KVBRIDGE_ENGINE_MODEL='meta-llama/x': not a model directory"):
        engine_mode_from_env(gpu_env(Path("meta-llama/x")))
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}}))
    with pytest.raises(EngineModeError, match=r"vocab_size 300 < 512"):
        engine_mode_from_env(gpu_env(model))
    (model / "config.json").write_text("{not json")
    with pytest.raises(EngineModeError, match=r"unreadable config.json"):
        engine_mode_from_env({"KVBRIDGE_ENGINE_MODEL": str(model)})


def test_cpu_mode_may_serve_the_operator_s_model(model: Path) -> None:
    mode = engine_mode_from_env({"KVBRIDGE_ENGINE_MODEL": str(model)})
    assert mode == EngineMode(model=model) and not mode.gpu and mode.block_size == 32


def test_a_kvbridge_connector_engine_registers_its_http_address_unless_configured(model: Path, tmp_path: Path) -> None:
    connector = kvbridge_connector_overrides({"kvbridge_registry": "127.0.0.1:1"})
    prefill, decode = pd_specs(model, tmp_path, prefill_overrides=connector, decode_overrides=None)
    extra = transfer_config(engine_command(with_http_url(prefill, 8123), 8123, "p0"))["kv_connector_extra_config"]
    assert extra == {
        "bidirectional_kv_xfer": True,
        "kvbridge_registry": "127.0.0.1:1",
        "kvbridge_http_url": "http://127.0.0.1:8123",
    }
    assert with_http_url(decode, 8124) == decode  # the stock connector registers nothing
    configured = pd_specs(
        model,
        tmp_path,
        prefill_overrides=kvbridge_connector_overrides(
            {"kvbridge_registry": "127.0.0.1:1", "kvbridge_http_url": "http://engine-0:8000"}
        ),
    )[0]
    assert with_http_url(configured, 8123) == configured


def test_engine_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """An engine binds its ports tens of seconds after they are picked: an ephemeral port could be taken by any
    outgoing connection meanwhile (an engine's own loopback connections once took D's NIXL side channel)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    assert len(ports) > 40  # spread over the range, not one port again and again
