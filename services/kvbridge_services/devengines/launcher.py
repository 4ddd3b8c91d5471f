"""Start and stop real vLLM engines (one prefill + one decode) for development and e2e tests.

CPU mode (the default): flags and environment follow what worked on CPU-only machines (shared notes on vLLM
CPU P/D): NIXL over UCX TCP on loopback, host KV buffer, block size 32, eager mode, each engine pinned to
one core. GPU mode (``KVBRIDGE_ENGINE_DEVICE=cuda``, see ``engine_mode_from_env`` and docs/gpu.md): a real
model, one GPU per engine (``CUDA_VISIBLE_DEVICES``), ``--gpu-memory-utilization``, block size 16, KV buffer on
the GPU, no ``VLLM_CPU_*`` and no core pinning. Each engine runs in its own process group (its own session),
so stopping it kills its engine-core and worker children too, and a Ctrl-C in the terminal reaches only the
process that started it, which then stops the groups.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge import secret as kvsecret

BLOCK_SIZE = 32
# Starts take 45-60 s alone; one took 12 min while other engines ran.
DEFAULT_START_TIMEOUT_S = 15 * 60.0
STOCK_CONNECTOR = "NixlConnector"
KVBRIDGE_CONNECTOR = "KvbridgeConnector"
KVBRIDGE_CONNECTOR_MODULE = "kvbridge_connector.connector"
SERVED_MODEL_NAME = "tiny"

Progress = Callable[[str], None]

# ---------------------------------------------------------------- engine mode (CPU or GPU), from settings

ENV_DEVICE = "KVBRIDGE_ENGINE_DEVICE"
ENV_MODEL = "KVBRIDGE_ENGINE_MODEL"
ENV_PREFILL_GPUS = "KVBRIDGE_PREFILL_GPUS"
ENV_DECODE_GPUS = "KVBRIDGE_DECODE_GPUS"
ENV_GPU_MEMORY_UTILIZATION = "KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION"
ENV_DTYPE = "KVBRIDGE_ENGINE_DTYPE"
GPU_ONLY_SETTINGS = (ENV_PREFILL_GPUS, ENV_DECODE_GPUS, ENV_GPU_MEMORY_UTILIZATION, ENV_DTYPE)
GPU_BLOCK_SIZE = 16
GPU_DTYPES = ("auto", "bfloat16", "float16", "float32")
# --gpu-memory-utilization defaults: a GPU per engine, or one GPU shared by both (then the two add up).
GPU_MEMORY_UTILIZATION_OWN = 0.85
GPU_MEMORY_UTILIZATION_SHARED = 0.4
GPU_MEMORY_UTILIZATION_SUM_MAX = 0.95  # what two engines on one GPU may take together
# The e2e tests and the bench send token ids drawn from [8, 512) (tests/e2e/pd_client.random_tokens).
MIN_VOCAB_SIZE = 512


class EngineModeError(ValueError):
    """A KVBRIDGE_ENGINE_* / KVBRIDGE_*_GPUS setting is invalid; the message names it and what is accepted."""


@dataclass(frozen=True)
class EngineMode:
    """Where the engines run. ``CPU_MODE`` is the launcher's behaviour without any setting."""

    device: str = "cpu"  # cpu | cuda
    # A model directory the operator has (None: the caller's generated tiny model; required on cuda).
    model: Path | None = None
    prefill_gpus: str = ""  # CUDA_VISIBLE_DEVICES of the prefill engine (cuda only)
    decode_gpus: str = ""
    gpu_memory_utilization: float = 0.0  # per engine (cuda only)
    dtype: str = "float32"
    block_size: int = BLOCK_SIZE

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


CPU_MODE = EngineMode()


def _model_dir(raw: str) -> Path:
    path = Path(raw).expanduser()
    if not (path / "config.json").is_file():
        raise EngineModeError(
            f"{ENV_MODEL}={raw!r}: not a model directory (no config.json there); give the "
            "local path of a Hugging Face-format model (engines start with HF_HUB_OFFLINE=1)"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineModeError(f"{ENV_MODEL}={raw!r}: unreadable config.json: {exc}") from exc
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if isinstance(vocab, int) and vocab < MIN_VOCAB_SIZE:
        raise EngineModeError(
            f"{ENV_MODEL}={raw!r}: vocab_size {vocab} < {MIN_VOCAB_SIZE}; the e2e tests and the "
            f"bench send token ids up to {MIN_VOCAB_SIZE - 1}"
        )
    return path


def _gpu_id(name: str, raw: str) -> str:
    value = raw.strip()
    if not value.isdigit():
        raise EngineModeError(
            f"{name}={raw!r}: give one GPU index (e.g. 0), used as the engine's "
            "CUDA_VISIBLE_DEVICES; one GPU per engine (no tensor parallelism here)"
        )
    return str(int(value))


def engine_mode_from_env(env: Mapping[str, str] | None = None) -> EngineMode:
    """The engine mode the settings select (``os.environ`` by default); EngineModeError names a bad one.

    ``KVBRIDGE_ENGINE_DEVICE``: ``cpu`` (default) or ``cuda``. ``KVBRIDGE_ENGINE_MODEL``: a model directory
    (required on cuda; on cpu it replaces the generated tiny model). cuda only: ``KVBRIDGE_PREFILL_GPUS`` /
    ``KVBRIDGE_DECODE_GPUS`` (one GPU index each, default 0 / 1; the same index = both on one GPU),
    ``KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION`` (per engine; default 0.85, or 0.4 on a shared GPU; on a
    shared GPU twice the value must stay <= 0.95), ``KVBRIDGE_ENGINE_DTYPE`` (auto, bfloat16, float16, float32;
    default auto). Block size: 32 on cpu, 16 on cuda.
    """
    env = os.environ if env is None else env
    device = env.get(ENV_DEVICE, "").strip().lower() or "cpu"
    if device not in ("cpu", "cuda"):
        raise EngineModeError(f"{ENV_DEVICE}={env[ENV_DEVICE]!r}: must be cpu or cuda")
    raw_model = env.get(ENV_MODEL, "").strip()
    model = _model_dir(raw_model) if raw_model else None
    if device == "cpu":
        stray = [name for name in GPU_ONLY_SETTINGS if env.get(name, "").strip()]
        if stray:
            raise EngineModeError(
                f"{', '.join(stray)} set but {ENV_DEVICE} is not cuda: "
                f"set {ENV_DEVICE}=cuda to run the engines on GPUs, or unset them"
            )
        return EngineMode(model=model)
    if model is None:
        raise EngineModeError(
            f"{ENV_DEVICE}=cuda needs {ENV_MODEL}: the local directory of a model the host has "
            "(the generated tiny test model is CPU-only)"
        )
    prefill = _gpu_id(ENV_PREFILL_GPUS, env.get(ENV_PREFILL_GPUS, "").strip() or "0")
    decode = _gpu_id(ENV_DECODE_GPUS, env.get(ENV_DECODE_GPUS, "").strip() or "1")
    shared = prefill == decode
    raw_util = env.get(ENV_GPU_MEMORY_UTILIZATION, "").strip()
    if raw_util:
        try:
            util = float(raw_util)
        except ValueError:
            util = -1.0
        if not 0.0 < util < 1.0:
            raise EngineModeError(
                f"{ENV_GPU_MEMORY_UTILIZATION}={raw_util!r}: a fraction in (0, 1) of each engine's GPU memory"
            )
    else:
        util = GPU_MEMORY_UTILIZATION_SHARED if shared else GPU_MEMORY_UTILIZATION_OWN
    if shared and 2 * util > GPU_MEMORY_UTILIZATION_SUM_MAX:
        raise EngineModeError(
            f"{ENV_PREFILL_GPUS} and {ENV_DECODE_GPUS} are both GPU {prefill}: the two engines share its memory, "
            f"so {ENV_GPU_MEMORY_UTILIZATION}={util:g} (each) must be <= {GPU_MEMORY_UTILIZATION_SUM_MAX / 2:g}"
        )
    dtype = env.get(ENV_DTYPE, "").strip() or "auto"
    if dtype not in GPU_DTYPES:
        raise EngineModeError(f"{ENV_DTYPE}={dtype!r}: one of {', '.join(GPU_DTYPES)}")
    return EngineMode("cuda", model, prefill, decode, util, dtype, GPU_BLOCK_SIZE)


def _stderr_progress(msg: str) -> None:
    print(f"[vllm_engines] {msg}", file=sys.stderr, flush=True)


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range, for a server that binds it later
    (an engine tens of seconds into its start, an etcd or service process). A port bind(0) returned is an
    ephemeral one that any outgoing connection may take meanwhile: a decode engine's own loopback connections
    once took its NIXL side-channel port and it hung, and a test's etcd once found its port taken. The kernel
    never picks these for connections."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # the range is full: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EngineSpec:
    """How to start one vLLM engine."""

    name: str  # "prefill" or "decode": also the log file stem
    kv_role: str  # kv_producer | kv_consumer
    model_dir: Path
    log_dir: Path
    cpu_core: int = 0
    kv_connector: str = STOCK_CONNECTOR
    kv_connector_module_path: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    kv_cache_gib: int = 1
    max_model_len: int = 1024
    # float32: with bfloat16 vLLM picks the AMX attention kernel, which dies with
    # SIGILL on this VM once a request has cached (pulled) tokens.
    dtype: str = "float32"
    engine_id: str | None = None
    # HTTP port; None: a free one picked at start.
    port: int | None = None
    # GPU mode (apply_mode): device, the engine's CUDA_VISIBLE_DEVICES, --gpu-memory-utilization, block size.
    device: str = "cpu"
    cuda_visible_devices: str = ""
    gpu_memory_utilization: float = 0.0
    block_size: int = BLOCK_SIZE


@dataclass
class Engine:
    """A running engine: where to reach it and how to stop it."""

    spec: EngineSpec
    port: int
    side_channel_port: int
    engine_id: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        return post_json(self.url + path, body, timeout_s)

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as response:
            return str(response.read().decode())

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise RuntimeError(f"POST {url} -> HTTP {error.code}: {detail[:2000]}") from error


# kv_connector_extra_config settings that are credentials, and the environment variable the kvbridge connector
# reads each from when the extra config lacks it (kvbridge_connector/settings.py). The launcher passes them in the
# engine's environment, never on its command line: any local user can read a process's command line (ps,
# /proc/<pid>/cmdline), only its owner its environment (/proc/<pid>/environ is 0400).
CREDENTIAL_ENV = {
    "kvbridge_hash_secret": kvsecret.ENV,
    "kvbridge_api_key": "KVBRIDGE_API_KEY",
    "kvbridge_telemetry_hash_key_hex": "KVBRIDGE_TELEMETRY_HASH_KEY_HEX",
}


def credential_env(spec: EngineSpec) -> dict[str, str]:
    """The engine's credentials from its extra config, as the environment variables its connector reads."""
    return {env: str(spec.extra_config[key]) for key, env in CREDENTIAL_ENV.items() if spec.extra_config.get(key)}


def kv_transfer_config(spec: EngineSpec, engine_id: str) -> dict[str, Any]:
    """vLLM's --kv-transfer-config: the extra config without its credentials (``engine_env`` carries them)."""
    extra: dict[str, Any] = {"bidirectional_kv_xfer": True}
    extra.update((k, v) for k, v in spec.extra_config.items() if k not in CREDENTIAL_ENV)
    config: dict[str, Any] = {
        "kv_connector": spec.kv_connector,
        "kv_role": spec.kv_role,
        "kv_buffer_device": "cuda" if spec.device == "cuda" else "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }
    if spec.kv_connector_module_path:
        config["kv_connector_module_path"] = spec.kv_connector_module_path
    # A failed pull (P reading D's retained KV, or D reading P's new KV: a dead peer, or NIXL's fixed
    # 5 s handshake deadline missed on a loaded host) is then slower, not an error.
    config["kv_load_failure_policy"] = "recompute"
    return config


def kvbridge_connector_overrides(extra_config: dict[str, Any]) -> dict[str, Any]:
    """EngineSpec overrides for the kvbridge connector with these ``kv_connector_extra_config`` settings."""
    return {
        "kv_connector": KVBRIDGE_CONNECTOR,
        "kv_connector_module_path": KVBRIDGE_CONNECTOR_MODULE,
        "extra_config": dict(extra_config),
    }


def engine_command(spec: EngineSpec, port: int, engine_id: str) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        str(spec.block_size),
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        "8",
        "--dtype",
        spec.dtype,
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(spec, engine_id)),
    ]
    if spec.device == "cuda":
        command += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.kv_role == "kv_producer":
        command.append("--no-enable-prefix-caching")  # model a cold prefill
    return command + spec.extra_args


def engine_env(spec: EngineSpec, side_channel_port: int) -> dict[str, str]:
    if spec.device == "cuda":
        # GPU engines: their GPU; no VLLM_CPU_* (inherited ones dropped) and no UCX transport list (UCX picks
        # its CUDA transports itself; an operator's UCX_* settings pass through).
        env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_CPU_")}
        env["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    else:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": str(spec.cpu_core),
                "UCX_TLS": "tcp,self,sm",
                "UCX_NET_DEVICES": "lo",
            }
        )
    # Both: the NIXL side channel on loopback, offline, quiet, unbuffered.
    env.update(
        {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(credential_env(spec))
    env.update(spec.extra_env)
    return env


def with_http_url(spec: EngineSpec, port: int) -> EngineSpec:
    """A kvbridge-connector engine registers where its HTTP server listens (a gateway that routes to the engines
    the registry lists needs it), unless its configuration says otherwise."""
    extra = spec.extra_config
    if spec.kv_connector != KVBRIDGE_CONNECTOR or not extra.get("kvbridge_registry") or "kvbridge_http_url" in extra:
        return spec
    return replace(spec, extra_config={**extra, "kvbridge_http_url": f"http://127.0.0.1:{port}"})


def start_engine(spec: EngineSpec) -> Engine:
    """Spawn the server (no waiting); logs go to <log_dir>/<name>.log."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    port, side_channel_port = spec.port or free_port(), free_port()
    spec = with_http_url(spec, port)
    engine_id = spec.engine_id or f"{spec.name}-{port}"
    log_path = spec.log_dir / f"{spec.name}.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        engine_command(spec, port, engine_id),
        env=engine_env(spec, side_channel_port),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log_file.close()
    return Engine(spec, port, side_channel_port, engine_id, process, log_path)


def _healthy(engine: Engine) -> bool:
    try:
        with urllib.request.urlopen(engine.url + "/health", timeout=5) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class HealthWatch:
    """One poll at a time over starting engines, so a blocking and an asyncio waiter share the logic.

    ``poll()`` returns True once every engine answers /health; it raises RuntimeError when one exited and
    TimeoutError past ``timeout_s`` (both with log tails), and reports progress every ``report_every_s``.
    """

    POLL_INTERVAL_S = 2.0

    def __init__(
        self,
        engines: list[Engine],
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
        *,
        progress: Progress = _stderr_progress,
        report_every_s: float = 30.0,
    ) -> None:
        self.pending = list(engines)
        self.timeout_s = timeout_s
        self._progress = progress
        self._report_every_s = report_every_s
        self._started = time.monotonic()
        self._last_report = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def poll(self) -> bool:
        elapsed = self.elapsed()
        for engine in list(self.pending):
            if engine.process.poll() is not None:
                raise RuntimeError(f"{engine.spec.name} exited with {engine.process.returncode}:\n{engine.log_tail()}")
            if _healthy(engine):
                moved = place_worker_threads(engine)
                self._progress(f"{engine.spec.name} healthy after {elapsed:.0f}s (worker threads placed: {moved})")
                self.pending.remove(engine)
        if not self.pending:
            return True
        if elapsed > self.timeout_s:
            tails = "\n".join(f"--- {e.spec.name} ({e.log_path}):\n{e.log_tail()}" for e in self.pending)
            raise TimeoutError(f"engines not healthy after {self.timeout_s:.0f}s:\n{tails}")
        if elapsed - self._last_report >= self._report_every_s:
            self._last_report = elapsed
            names = ", ".join(e.spec.name for e in self.pending)
            self._progress(f"waiting for {names} ({elapsed:.0f}s)")
        return False


def _group_workers(pgid: int) -> list[int]:
    """Pids of the engine's vLLM worker processes (its process group holds server, engine core, workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        if int(fields[2]) == pgid and name.startswith("VLLM::Worker"):
            pids.append(int(entry))
    return pids


def place_worker_threads(engine: Engine) -> str:
    """Pin every thread of the engine's worker processes to ``cpu_core``, the model's thread included.

    vLLM's CPU worker binds only OpenMP to VLLM_CPU_OMP_THREADS_BIND. On the 2-core dev VM the prefill worker's
    main thread was found on the decode core and NIXL's progress thread, which polls without pause, on the
    prefill core: a 384-token prefill then took 52 s instead of ~2 s (bench/results/ttft.md). Moving P's NIXL
    threads to the decode core instead overloaded that core. Threads created later inherit the creating
    thread's core. Returns what was done, for the progress line.
    """
    if engine.spec.device == "cuda":
        return "none (GPU engine: no core pinning)"
    if not hasattr(os, "sched_setaffinity"):
        return "not supported here"
    core = engine.spec.cpu_core % (os.cpu_count() or 1)
    placed = 0
    for pid in _group_workers(engine.process.pid):
        with suppress(OSError):
            for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
                with suppress(OSError):
                    os.sched_setaffinity(tid, {core})
                    placed += 1
    return f"{placed} threads on core {core}"


def wait_healthy(
    engines: list[Engine], timeout_s: float = DEFAULT_START_TIMEOUT_S, *, progress: Progress = _stderr_progress
) -> None:
    """Poll /health of every engine, printing progress; raise with log tails on failure."""
    watch = HealthWatch(engines, timeout_s, progress=progress)
    while not watch.poll():
        time.sleep(watch.POLL_INTERVAL_S)


def stop_engine(engine: Engine, grace_s: float = 20.0) -> None:
    """SIGTERM the engine's process group, SIGKILL what is left after grace_s."""
    if engine.process.poll() is None or group_alive(engine.process.pid):
        _signal_group(engine.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        # poll() reaps the server itself: as a zombie it would keep the group "alive" for the whole grace.
        while time.monotonic() < deadline and (engine.process.poll() is None or group_alive(engine.process.pid)):
            time.sleep(0.2)
        _signal_group(engine.process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        engine.process.wait(timeout=10)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (a zombie leader counts until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class PDEngines:
    prefill: Engine
    decode: Engine
    model_dir: Path


def apply_mode(spec: EngineSpec, mode: EngineMode, gpus: str) -> None:
    """Set a spec's device fields from ``mode`` (``gpus``: this engine's CUDA_VISIBLE_DEVICES); CPU: no change."""
    if not mode.gpu:
        return
    spec.device, spec.cuda_visible_devices = mode.device, gpus
    spec.gpu_memory_utilization, spec.dtype, spec.block_size = mode.gpu_memory_utilization, mode.dtype, mode.block_size


def pd_specs(
    model_dir: Path,
    log_dir: Path,
    *,
    prefill_overrides: dict[str, Any] | None = None,
    decode_overrides: dict[str, Any] | None = None,
    mode: EngineMode = CPU_MODE,
) -> tuple[EngineSpec, EngineSpec]:
    """Specs of one prefill (core 0 / ``mode.prefill_gpus``) and one decode (core 1 / ``mode.decode_gpus``)
    engine; overrides are EngineSpec fields, applied after the mode."""
    cores = os.cpu_count() or 1
    # Each engine confined to its own core, NIXL threads included (place_worker_threads): two one-core machines.
    prefill_spec = EngineSpec("prefill", "kv_producer", model_dir, log_dir, cpu_core=0)
    decode_spec = EngineSpec("decode", "kv_consumer", model_dir, log_dir, cpu_core=1 % cores)
    apply_mode(prefill_spec, mode, mode.prefill_gpus)
    apply_mode(decode_spec, mode, mode.decode_gpus)
    for spec, overrides in ((prefill_spec, prefill_overrides), (decode_spec, decode_overrides)):
        for key, value in (overrides or {}).items():
            if not hasattr(spec, key):
                raise TypeError(f"EngineSpec has no field {key!r}")
            setattr(spec, key, value)
    return prefill_spec, decode_spec


@contextmanager
def run_pd_engines(
    model_dir: Path,
    log_dir: Path,
    *,
    prefill_overrides: dict[str, Any] | None = None,
    decode_overrides: dict[str, Any] | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    progress: Progress = _stderr_progress,
    mode: EngineMode = CPU_MODE,
) -> Iterator[PDEngines]:
    """One prefill (core 0) and one decode (core 1) engine, stopped on exit; on GPUs as ``mode`` says.

    Overrides are EngineSpec fields (kv_connector, kv_connector_module_path,
    extra_config, extra_args, extra_env, ...).
    """
    prefill_spec, decode_spec = pd_specs(
        model_dir, log_dir, prefill_overrides=prefill_overrides, decode_overrides=decode_overrides, mode=mode
    )
    engines: list[Engine] = []
    try:
        engines.append(start_engine(prefill_spec))
        engines.append(start_engine(decode_spec))
        wait_healthy(engines, start_timeout_s, progress=progress)
        yield PDEngines(engines[0], engines[1], model_dir)
    finally:
        for engine in engines:
            stop_engine(engine)
