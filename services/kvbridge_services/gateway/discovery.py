"""Stock engines given by URL (compatibility mode, ADR 0027): what the gateway needs to register one — the model it
serves, its KV block size and its NIXL identity (engine id, side-channel host and port) — is what the engine itself
states at the URL the operator configured, never what a client sent.

- model: ``/v1/models`` (the one model it serves that is not a LoRA adapter), unless configured;
- block size: ``/metrics``, vLLM's ``vllm:cache_config_info`` gauge (``v1/metrics/loggers.py`` log_metrics_info: one
  label per CacheConfig field, ``block_size`` among them). A block size the engine does not state is never guessed:
  entries hashed and cut at a wrong block size would make P read blocks that hold other tokens;
- NIXL identity: the ``kv_transfer_params`` the engine returns for a one-token probe sent as the gateway's prefill is
  (``do_remote_decode``): vLLM's NixlConnector answers ``remote_engine_id``, ``remote_host``, ``remote_port`` (its
  ``request_finished``, ``nixl/pull_scheduler.py``), the same values D's decode responses carry and the registrar
  checks (``Skip.ENGINE_MISMATCH``). The probe's one block is held by the engine for its ``kv_lease_duration``
  (30 s by default), then freed.

The checks are pure (:func:`resolve`); :func:`discover` does the HTTP calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .config import StaticEngine
from .upstream import TRANSPORT_ERRORS, ClientError, EngineHttp, UpstreamError

CACHE_CONFIG_INFO = "vllm:cache_config_info"
PROBE_PROMPT = "kvbridge engine identity probe"
PROBE_TIMEOUT_S = 30.0
# One sample line of the gauge: its labels and value (prometheus text format, label values with escapes).
_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^\n]*)\}\s+(?P<value>\S+)", re.MULTILINE)
_LABEL = re.compile(r'(?P<name>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_MAX_ENGINE_ID = 256
_MAX_HOST = 253


class Unreachable(Exception):
    """The engine did not answer (not started yet, down, or an error status): try again later."""


class Undiscoverable(ValueError):
    """The engine answered, but does not state every field the gateway needs: a configuration to fix."""

    def __init__(self, url: str, role: str, missing: Iterable[str], detail: str, *, env: str) -> None:
        self.url, self.role, self.missing, self.detail = url, role, tuple(missing), detail
        fields = ", ".join(f'"{f}": ...' for f in self.missing)
        example = f'{{"url": "{url}", {fields}}}'
        super().__init__(
            f"engine {url} ({role}) cannot be registered for reuse: {', '.join(self.missing)} not stated by the engine"
            f" ({detail}); set {'them' if len(self.missing) > 1 else 'it'} in {env} ({example}), or"
            f' "register_in_registry": false (or KVBRIDGE_GATEWAY_REGISTER_STATIC_ENGINES=false) to route it'
            " without reuse"
        )


@dataclass(frozen=True, slots=True)
class Identity:
    """What the gateway registers for a stock engine; ``stated``: the fields the engine itself stated."""

    engine_id: str
    model: str
    kv_host: str
    kv_port: int
    block_size: int
    stated: frozenset[str]

    @property
    def probed(self) -> bool:
        """Whether the NIXL identity came from the engine (it may change when the engine restarts)."""
        return "engine_id" in self.stated


@dataclass(frozen=True, slots=True)
class Statement:
    """What the engine said: None where it said nothing (or was not asked)."""

    models: tuple[str, ...] | None = None  # served models that are not LoRA adapters
    block_sizes: frozenset[int] | None = None
    params: Mapping[str, object] | None = None
    probe_refused: str = ""  # the engine answered the probe with an error status (4xx)


def block_sizes(metrics_text: str) -> frozenset[int]:
    """Every ``block_size`` the ``vllm:cache_config_info`` samples state (one per engine core); empty: none."""
    sizes: set[int] = set()
    for line in _INFO_LINE.finditer(metrics_text):
        labels = {m["name"]: m["value"] for m in _LABEL.finditer(line["labels"])}
        value = labels.get("block_size", "")
        if value.isdigit() and 0 < int(value) <= 1024:
            sizes.add(int(value))
    return frozenset(sizes)


def served_models(models_json: object) -> tuple[str, ...]:
    """The ids ``/v1/models`` lists that are not LoRA adapters (vLLM lists an adapter with its base as parent)."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    out: list[str] = []
    for card in data[:64] if isinstance(data, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            parent = card.get("parent")
            if not parent or parent == card["id"]:
                out.append(card["id"])
    return tuple(out)


def resolve(spec: StaticEngine, role: str, said: Statement, *, env: str) -> Identity:
    """The identity to register: configured fields, else the engine's statement. Raises :class:`Undiscoverable`
    naming every field that is neither, or that the engine states otherwise than configured (engine id, block
    size, model). Configured host and port win over stated ones (the engine may state an address only its own
    network reaches)."""
    missing: list[str] = []
    details: list[str] = []
    stated: set[str] = set()

    model = spec.model
    if said.models is not None:
        if model and model not in said.models:
            missing.append("model")
            details.append(f"it serves {', '.join(said.models) or 'no model'}, not {model!r}")
        elif not model and len(said.models) == 1:
            model = said.models[0]
            stated.add("model")
    if not model and "model" not in missing:
        missing.append("model")
        details.append(f"it serves {', '.join(said.models)}" if said.models else "/v1/models lists no model")

    block_size = 0
    if said.block_sizes:
        if len(said.block_sizes) > 1:
            details.append(f"its engine cores state block sizes {sorted(said.block_sizes)}")
        elif spec.block_size and spec.block_size not in said.block_sizes:
            details.append(f"configured {spec.block_size}, the engine states {next(iter(said.block_sizes))}")
        else:
            block_size = next(iter(said.block_sizes))
            stated.add("block_size")
    elif spec.block_size:
        block_size = spec.block_size  # the operator's word, for an engine whose /metrics does not say
    else:
        details.append(f"its /metrics has no {CACHE_CONFIG_INFO} with a block_size: --disable-log-stats?")
    if not block_size:
        missing.append("block_size")

    engine_id, kv_host, kv_port = spec.engine_id, spec.kv_host, spec.kv_port
    if not (engine_id and kv_host and kv_port):
        params = said.params
        if params is None:
            details.append(
                said.probe_refused
                or "its responses carry no kv_transfer_params: start vLLM with --kv-transfer-config naming"
                " NixlConnector"
            )
        else:
            sid, shost, sport = params.get("remote_engine_id"), params.get("remote_host"), params.get("remote_port")
            if isinstance(sid, str) and 0 < len(sid) <= _MAX_ENGINE_ID:
                if engine_id and engine_id != sid:
                    details.append(f"engine_id configured {engine_id!r}, the engine states {sid!r}")
                    missing.append("engine_id")
                else:
                    engine_id = sid
                    stated.add("engine_id")
            if not kv_host and isinstance(shost, str) and 0 < len(shost) <= _MAX_HOST:
                kv_host = shost
                stated.add("kv_host")
            if not kv_port and isinstance(sport, int) and not isinstance(sport, bool) and 0 < sport < 65536:
                kv_port = sport
                stated.add("kv_port")
            if not (engine_id and kv_host and kv_port):
                details.append("its kv_transfer_params lack remote_engine_id, remote_host or remote_port")
    for name, value in (("engine_id", engine_id), ("kv_host", kv_host), ("kv_port", kv_port)):
        if not value and name not in missing:
            missing.append(name)
    if missing:
        raise Undiscoverable(spec.url, role, missing, "; ".join(details), env=env)
    return Identity(engine_id, model, kv_host, kv_port, block_size, frozenset(stated))


async def discover(http: EngineHttp, spec: StaticEngine, role: str, *, timeout_s: float, env: str) -> Identity:
    """Asks the engine at ``spec.url`` what :func:`resolve` needs. Raises :class:`Unreachable` when it does not
    answer and something must come from it, :class:`Undiscoverable` when it answered without it."""
    url = spec.url
    needs_identity = not (spec.engine_id and spec.kv_host and spec.kv_port)
    try:
        models: tuple[str, ...] | None = None
        if not spec.model or needs_identity:
            resp = await http.get(f"{url}/v1/models", timeout_s=timeout_s)
            if resp.status != 200:
                raise Unreachable(f"/v1/models answered {resp.status}")
            models = served_models(resp.json())
        resp = await http.get(f"{url}/metrics", timeout_s=timeout_s)
        sizes = block_sizes(resp.text) if resp.status == 200 else None
        if sizes is None and not spec.block_size:
            raise Unreachable(f"/metrics answered {resp.status}")
        said = Statement(models=models, block_sizes=sizes)
        if needs_identity:
            model = spec.model or (models[0] if models and len(models) == 1 else "")
            if model:
                said = await _probe(http, url, model, said)
    except TRANSPORT_ERRORS as exc:
        if not needs_identity and spec.model and spec.block_size:
            said = Statement()  # configured in full: registered as configured while it does not answer
        else:
            raise Unreachable(str(exc) or type(exc).__name__) from exc
    except (ValueError, json.JSONDecodeError) as exc:  # a body that is not what vLLM answers
        raise Undiscoverable(url, role, ["model"], f"/v1/models is not vLLM's: {exc}", env=env) from exc
    return resolve(spec, role, said, env=env)


async def _probe(http: EngineHttp, url: str, model: str, said: Statement) -> Statement:
    body = {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    try:
        answer = await http.post_json(f"{url}/v1/completions", body, timeout_s=PROBE_TIMEOUT_S)
    except ClientError as exc:  # it answered, and refused: no 4xx turns into a statement on a retry
        message = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else exc.body
        refused = f"it refused the identity probe ({exc.status}: {str(message)[:200]})"
        return Statement(said.models, said.block_sizes, None, refused)
    except UpstreamError as exc:
        raise Unreachable(str(exc)) from exc
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return Statement(said.models, said.block_sizes, params if isinstance(params, dict) else None)
