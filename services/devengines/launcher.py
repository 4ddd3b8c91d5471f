"""Start and stop real vLLM CPU engines (one prefill + one decode) for development and e2e tests.

Flags and environment follow what worked on CPU-only machines (shared notes on vLLM CPU P/D): NIXL over
UCX TCP on loopback, host KV buffer, block size 32, eager mode. Each engine runs in its own process
group (its own session), so stopping it kills its engine-core and worker children too, and a Ctrl-C in
the terminal reaches only the process that started it, which then stops the groups.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
# Starts take 45-60 s alone; one took 12 min while other engines ran.
DEFAULT_START_TIMEOUT_S = 15 * 60.0
STOCK_CONNECTOR = "NixlConnector"
KVBRIDGE_CONNECTOR = "KvbridgeConnector"
KVBRIDGE_CONNECTOR_MODULE = "kvbridge_connector.connector"
SERVED_MODEL_NAME = "tiny"

Progress = Callable[[str], None]


def _stderr_progress(msg: str) -> None:
    print(f"[vllm_engines] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A loopback port that is free now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
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
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise RuntimeError(f"POST {url} -> HTTP {error.code}: {detail[:2000]}") from error


def kv_transfer_config(spec: EngineSpec, engine_id: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"bidirectional_kv_xfer": True}
    extra.update(spec.extra_config)
    config: dict[str, Any] = {
        "kv_connector": spec.kv_connector,
        "kv_role": spec.kv_role,
        "kv_buffer_device": "cpu",
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
    return {"kv_connector": KVBRIDGE_CONNECTOR, "kv_connector_module_path": KVBRIDGE_CONNECTOR_MODULE,
            "extra_config": dict(extra_config)}


def engine_command(spec: EngineSpec, port: int, engine_id: str) -> list[str]:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(spec.max_model_len), "--max-num-seqs", "8",
        "--dtype", spec.dtype, "--seed", "0",
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec, engine_id)),
    ]
    if spec.kv_role == "kv_producer":
        command.append("--no-enable-prefix-caching")  # model a cold prefill
    return command + spec.extra_args


def engine_env(spec: EngineSpec, side_channel_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(spec.cpu_core),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "UCX_TLS": "tcp,self,sm",
        "UCX_NET_DEVICES": "lo",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(spec.extra_env)
    return env


def start_engine(spec: EngineSpec) -> Engine:
    """Spawn the server (no waiting); logs go to <log_dir>/<name>.log."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    port, side_channel_port = spec.port or free_port(), free_port()
    engine_id = spec.engine_id or f"{spec.name}-{port}"
    log_path = spec.log_dir / f"{spec.name}.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        engine_command(spec, port, engine_id), env=engine_env(spec, side_channel_port),
        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
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

    def __init__(self, engines: list[Engine], timeout_s: float = DEFAULT_START_TIMEOUT_S, *,
                 progress: Progress = _stderr_progress, report_every_s: float = 30.0) -> None:
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
                raise RuntimeError(
                    f"{engine.spec.name} exited with {engine.process.returncode}:\n{engine.log_tail()}")
            if _healthy(engine):
                moved = place_worker_threads(engine)
                self._progress(f"{engine.spec.name} healthy after {elapsed:.0f}s "
                               f"(worker threads placed: {moved})")
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


def wait_healthy(engines: list[Engine], timeout_s: float = DEFAULT_START_TIMEOUT_S, *,
                 progress: Progress = _stderr_progress) -> None:
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


def pd_specs(model_dir: Path, log_dir: Path, *, prefill_overrides: dict[str, Any] | None = None,
             decode_overrides: dict[str, Any] | None = None) -> tuple[EngineSpec, EngineSpec]:
    """Specs of one prefill (core 0) and one decode (core 1) engine; overrides are EngineSpec fields."""
    cores = os.cpu_count() or 1
    # Each engine confined to its own core, NIXL threads included (place_worker_threads): two one-core machines.
    prefill_spec = EngineSpec("prefill", "kv_producer", model_dir, log_dir, cpu_core=0)
    decode_spec = EngineSpec("decode", "kv_consumer", model_dir, log_dir, cpu_core=1 % cores)
    for spec, overrides in ((prefill_spec, prefill_overrides), (decode_spec, decode_overrides)):
        for key, value in (overrides or {}).items():
            if not hasattr(spec, key):
                raise TypeError(f"EngineSpec has no field {key!r}")
            setattr(spec, key, value)
    return prefill_spec, decode_spec


@contextmanager
def run_pd_engines(
    model_dir: Path, log_dir: Path, *,
    prefill_overrides: dict[str, Any] | None = None,
    decode_overrides: dict[str, Any] | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    progress: Progress = _stderr_progress,
) -> Iterator[PDEngines]:
    """One prefill (core 0) and one decode (core 1) engine, stopped on exit.

    Overrides are EngineSpec fields (kv_connector, kv_connector_module_path,
    extra_config, extra_args, extra_env, ...).
    """
    prefill_spec, decode_spec = pd_specs(model_dir, log_dir, prefill_overrides=prefill_overrides,
                                         decode_overrides=decode_overrides)
    engines: list[Engine] = []
    try:
        engines.append(start_engine(prefill_spec))
        engines.append(start_engine(decode_spec))
        wait_healthy(engines, start_timeout_s, progress=progress)
        yield PDEngines(engines[0], engines[1], model_dir)
    finally:
        for engine in engines:
            stop_engine(engine)
