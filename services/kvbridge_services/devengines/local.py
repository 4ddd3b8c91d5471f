"""One prefill + one decode vLLM CPU engine with the kvbridge connector, for ``kvbridge up --engines``.

The engines register themselves (the connector grants a node lease and calls RegisterEngine, with their
HTTP URL), so the gateway finds them in the registry; nothing is registered by hand here. All blocking
work (building the model, polling /health, stopping process groups) runs off the event loop, and
``start`` can be cancelled at any await: whatever was spawned is still stopped by ``stop``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge import secret as kvsecret
from kvbridge_services.devengines.launcher import (
    DEFAULT_START_TIMEOUT_S,
    SERVED_MODEL_NAME,
    Engine,
    HealthWatch,
    Progress,
    free_port,
    kvbridge_connector_overrides,
    pd_specs,
    start_engine,
    stop_engine,
)


def default_work_dir() -> Path:
    """``$XDG_CACHE_HOME/kvbridge`` (``~/.cache/kvbridge``): the generated model is reused across runs."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvbridge"


def missing_engine_packages() -> list[str]:
    """Python packages ``--engines`` needs that are not installed (checked without importing them)."""
    needed = ("vllm", "nixl", "torch", "transformers", "tokenizers", "kvbridge_connector")
    return [name for name in needed if importlib.util.find_spec(name) is None]


@dataclass
class LocalEnginesConfig:
    # Model in <work_dir>/<shape>-model (built once, reused), engine logs in <work_dir>/logs/.
    work_dir: Path = field(default_factory=default_work_dir)
    # The deployment secret (kvbridge.secret, hex) shared by the connectors and the gateway: KVBRIDGE_HASH_SECRET,
    # else fresh per run.
    hash_secret: str = field(default_factory=lambda: os.environ.get(kvsecret.ENV) or kvsecret.generate())
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    report_every_s: float = 10.0
    # The generated model's shape (kvbridge_services.devengines.model.SHAPES): "tiny" (2 layers, functional) or
    # "demo" (8 layers, hidden 768: a prefill cost worth saving); built into <work_dir>/<shape>-model.
    shape: str = "tiny"
    # The engines' --max-model-len (None: the launcher's default).
    max_model_len: int | None = None
    # Extra kv_connector_extra_config settings of the decode engine's connector (e.g. kvbridge_entry_lease_ttl_s).
    decode_extra: dict[str, object] = field(default_factory=dict)

    @property
    def hash_secret_hex(self) -> str:
        return self.hash_secret


class LocalEngines:
    def __init__(self, config: LocalEnginesConfig, progress: Progress) -> None:
        self.config = config
        self._progress = progress
        self.engines: list[Engine] = []
        self._builder: asyncio.subprocess.Process | None = None
        self._built = False

    @property
    def model_dir(self) -> Path:
        return self.config.work_dir / f"{self.config.shape}-model"

    @property
    def log_dir(self) -> Path:
        return self.config.work_dir / "logs"

    async def start(self, registry_address: str, lease_address: str) -> None:
        await self.build_model()
        common = {
            "kvbridge_registry": registry_address,
            "kvbridge_lease": lease_address,
            "kvbridge_hash_secret": self.config.hash_secret,
            "kvbridge_model": SERVED_MODEL_NAME,
        }
        ports = free_port(), free_port()
        sizing = {"max_model_len": self.config.max_model_len} if self.config.max_model_len else {}
        prefill, decode = pd_specs(
            self.model_dir,
            self.log_dir,
            prefill_overrides=dict(
                kvbridge_connector_overrides(dict(common, kvbridge_http_url=f"http://127.0.0.1:{ports[0]}")),
                port=ports[0],
                **sizing,
            ),
            decode_overrides=dict(
                kvbridge_connector_overrides(
                    dict(common, kvbridge_http_url=f"http://127.0.0.1:{ports[1]}", **self.config.decode_extra)
                ),
                port=ports[1],
                **sizing,
            ),
        )
        for spec in (prefill, decode):
            engine = start_engine(spec)
            self.engines.append(engine)
            self._progress(
                f"{spec.name} engine starting: {engine.url} (pid {engine.process.pid}, log {engine.log_path})"
            )
        self._progress("vLLM engines take about a minute to start (longer on a busy machine)")
        watch = HealthWatch(
            self.engines,
            self.config.start_timeout_s,
            progress=self._progress,
            report_every_s=self.config.report_every_s,
        )
        while True:  # polls over HTTP (no event to wait on)
            if await asyncio.to_thread(watch.poll):
                return
            await asyncio.sleep(watch.POLL_INTERVAL_S)

    async def build_model(self) -> None:
        """Builds the tiny model into ``model_dir`` (once; the gateway reads its tokenizer before engines start)."""
        if self._built:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._progress(f"{self.config.shape} random-weight model: {self.model_dir} (built on first use)")
        log_path = self.log_dir / "model-build.log"
        with log_path.open("wb") as log_file:
            # A child process: torch stays out of this one, and Ctrl-C can stop the build at once.
            self._builder = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvbridge_services.devengines.model",
                str(self.model_dir),
                "--shape",
                self.config.shape,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = await self._builder.wait()
        finally:
            if self._builder.returncode is None:
                with suppress(ProcessLookupError):
                    os.killpg(self._builder.pid, signal.SIGKILL)
                await self._builder.wait()
        if code != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"building the {self.config.shape} model failed (exit {code}, log {log_path}):\n{tail}")
        self._built = True

    def exited(self) -> Engine | None:
        """An engine whose server process has exited, if any."""
        return next((e for e in self.engines if e.process.poll() is not None), None)

    async def stop(self) -> None:
        """Stop every engine's process group (SIGTERM, then SIGKILL after a grace period)."""
        if self.engines:
            self._progress("stopping vLLM engines")
        await asyncio.gather(*(asyncio.to_thread(stop_engine, e) for e in self.engines))
