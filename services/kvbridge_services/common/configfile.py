"""Where a service's settings come from, checked before anything starts: the ``--config`` file, the ``KVBRIDGE_*``
environment, and the one-line messages a refused configuration or start prints.

The configuration file (``--config kvbridge.yaml``) is a YAML mapping from the environment's own names to values::

    KVBRIDGE_GATEWAY_HTTP_PORT: 8080
    KVBRIDGE_ETCD_ENDPOINTS: [etcd-1:2379, etcd-2:2379]
    KVBRIDGE_GATEWAY_PREFILL_ENGINES: [{url: "http://p:8000", model: m}]

A variable set in the environment overrides the file; a flag overrides both. A name in the file that no service
reads, or a ``KVBRIDGE_*`` variable in the environment that neither a service nor another kvbridge tool reads, is
refused with the closest valid name: a typo is never silently ignored.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import BaseSettings, NoDecode

from .settings_doc import env_names

PREFIX = "KVBRIDGE_"
# Exit codes of every service and of `kvbridge up` when they cannot start (docs/settings.md, "Failures to start").
EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_BIND, EXIT_STORE_UNREACHABLE = 0, 1, 2, 3, 4
SEE_ALSO = "every setting: --help, docs/settings.md"

# KVBRIDGE_* variables read by kvbridge tools other than the three services' settings models: never refused.
OTHER_ENV_NAMES: Mapping[str, str] = {
    "KVBRIDGE_REGISTRY_ADDRESS": "kvbridge CLI: the registry's address",
    "KVBRIDGE_LEASE_ADDRESS": "kvbridge CLI: the lease manager's address",
    "KVBRIDGE_BENCH_DIR": "kvbridge bench: the bench/ directory",
    "KVBRIDGE_ENGINE_DEVICE": "kvbridge up --engines (devengines/launcher.py): cpu or cuda",
    "KVBRIDGE_ENGINE_MODEL": "kvbridge up --engines: the model directory",
    "KVBRIDGE_ENGINE_DTYPE": "kvbridge up --engines: the engines' dtype",
    "KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION": "kvbridge up --engines: per-engine GPU memory share",
    "KVBRIDGE_PREFILL_GPUS": "kvbridge up --engines: the prefill engine's GPU",
    "KVBRIDGE_DECODE_GPUS": "kvbridge up --engines: the decode engine's GPU",
    "KVBRIDGE_ALLOW_UNSUPPORTED_VLLM": "the vLLM connector: run on an unsupported vLLM version",
    "KVBRIDGE_TEST_WORKERS": "scripts/test: pytest-xdist workers",
    "KVBRIDGE_GPU_LOGS": "scripts/gpu-runbook.sh: its logs",
    "KVBRIDGE_GPU_BENCH_OUT": "scripts/gpu-runbook.sh: its results directory",
    "KVBRIDGE_REGISTRY": "docs/sdk.md examples: the registry's address",
    "KVBRIDGE_LEASE": "docs/sdk.md examples, scripts/gpu-runbook.sh: the lease manager's address",
    "KVBRIDGE_GATEWAY": "docs/sdk.md examples: the gateway's gRPC address",
    "KVBRIDGE_MODEL": "docs/sdk.md examples: a served model",
    "KVBRIDGE_OPERATOR_API_KEY": "docs/sdk.md examples, deploy/scripts/gen-secrets.sh: an operator's key",
    "KVBRIDGE_CA_FILE": "docs/sdk.md TLS example: the CA file",
    "KVBRIDGE_TLS_REGISTRY": "docs/sdk.md TLS example: the registry's TLS address",
    "KVBRIDGE_TLS_SERVER_NAME": "docs/sdk.md TLS example: the certificate's name",
    "KVBRIDGE_CONNECTOR_API_KEY": "deploy/: the connectors' key",
    "KVBRIDGE_DEMO_API_KEY": "deploy/README.md: a tenant key for the example turn",
    "KVBRIDGE_IMAGE": "deploy/compose.yaml: the services' image",
    "KVBRIDGE_VLLM_IMAGE": "deploy/compose.yaml: the engines' image",
    "KVBRIDGE_JAEGER_IMAGE": "deploy/compose.yaml: the Jaeger image",
    "KVBRIDGE_ENVOY_IMAGE": "deploy/compose.yaml: the Envoy image",
    "KVBRIDGE_MODEL_DIR": "deploy/compose.yaml: the model directory",
    "KVBRIDGE_PROMETHEUS_IMAGE": "deploy/compose.yaml (profile monitoring): the Prometheus image",
    "KVBRIDGE_GRAFANA_IMAGE": "deploy/compose.yaml (profile monitoring): the Grafana image",
    "KVBRIDGE_DEBUG": "clients/node: print a failed call's stack trace",
    "KVBRIDGE_PYTHON": "scripts/fetch-vllm-wheels: the interpreter whose pip downloads the wheel",
}
# Settings whose value is redacted wherever kvbridge prints settings (kvbridge config check, error messages).
_SECRET_MARKERS = ("SECRET", "API_KEY", "HASH_KEY", "PASSWORD", "TOKEN_")


class ConfigError(ValueError):
    """A configuration refused before anything starts; its message is the one line printed."""


class StartError(Exception):
    """A start refused for another reason (a port, the store); ``code`` is the process's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in _SECRET_MARKERS) and not upper.endswith("_FILE")


def known_names(models: Iterable[type[BaseSettings]] = ()) -> frozenset[str]:
    """Every name a service reads (the catalog of all three, plus ``models`` in hand: a field added since the
    catalog was generated is known to its own process)."""
    # Imported here: settings_reference, which writes env_names.py, must import without it.
    from .env_names import SERVICE_ENV_NAMES

    names = set(SERVICE_ENV_NAMES)
    for model in models:
        for field in model.model_fields:
            names.update(env_names(model, field))
    return frozenset(names)


def _suggest(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest candidate, compared without the shared KVBRIDGE_ prefix."""
    by_suffix = {c.removeprefix(PREFIX): c for c in candidates}
    close = difflib.get_close_matches(name.removeprefix(PREFIX), sorted(by_suffix), n=1, cutoff=0.75)
    return f" (did you mean {by_suffix[close[0]]}?)" if close else ""


def check_environment(environ: Mapping[str, str], known: frozenset[str]) -> None:
    """ConfigError naming each ``KVBRIDGE_*`` variable that nothing reads, with the closest valid name."""
    unknown = sorted(
        n for n in environ if n.upper().startswith(PREFIX) and n.upper() not in known | OTHER_ENV_NAMES.keys()
    )
    if unknown:
        listed = ", ".join(f"{n}{_suggest(n.upper(), known)}" for n in unknown)
        raise ConfigError(
            f"unknown setting{'s' if len(unknown) > 1 else ''} in the environment: {listed}; fix or unset "
            f"{'them' if len(unknown) > 1 else 'it'} ({SEE_ALSO})"
        )


def _comma_names(models: Iterable[type[BaseSettings]]) -> set[str]:
    """Names whose environment value is a comma-separated list (NoDecode fields), not JSON."""
    names: set[str] = set()
    for model in models:
        for field, info in model.model_fields.items():
            if any(m is NoDecode or isinstance(m, NoDecode) for m in info.metadata):
                names.update(env_names(model, field))
    return names


def _as_env_value(name: str, value: object, comma_names: set[str], where: str) -> str:
    if value is None:
        raise ConfigError(f"{where}: {name} has no value; give one or leave the key out")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, list) and name in comma_names and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, list | dict):
        return json.dumps(value)
    raise ConfigError(f"{where}: {name} has a value of an unsupported type ({type(value).__name__})")


def read_config_file(path: Path, known: frozenset[str], models: Iterable[type[BaseSettings]] = ()) -> dict[str, str]:
    """The file's settings as environment values; ConfigError (one line) for an unreadable or malformed file or
    a name that no service reads."""
    import yaml  # PyYAML: only processes given --config pay for it

    where = f"--config {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc}); give a readable YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{line}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a YAML mapping of KVBRIDGE_* names to values (like the environment)")
    comma_names = _comma_names(models)
    values: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).upper()
        if name not in known:
            hint = (
                f"; {name} is read from the environment by {OTHER_ENV_NAMES[name].split(':')[0]}, not from a file"
                if name in OTHER_ENV_NAMES
                else _suggest(name, known)
            )
            raise ConfigError(f"{where}: unknown setting {key}{hint}; fix or remove it ({SEE_ALSO})")
        values[name] = _as_env_value(name, value, comma_names, where)
    return values


def apply_config_file(values: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Puts the file's settings into ``environ`` where the environment does not set them (the environment
    overrides the file); returns those taken from the file."""
    present = {n.upper() for n in environ}
    taken = {name: value for name, value in values.items() if name not in present}
    environ.update(taken)
    return taken


def load_environment(
    config: Path | None, models: Iterable[type[BaseSettings]], environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """What every composition root does first: the ``KVBRIDGE_*`` environment checked for unknown names, then the
    ``--config`` file (if any) read, checked and applied beneath it. Returns the settings taken from the file."""
    env = os.environ if environ is None else environ
    models = list(models)
    known = known_names(models)
    check_environment(env, known)
    if config is None:
        return {}
    return apply_config_file(read_config_file(config, known, models), env)


@dataclass(frozen=True)
class Origin:
    """Where settings came from, for messages: the file's settings and the flags given (field name -> flag)."""

    from_file: Mapping[str, str]
    config_path: Path | None = None
    flags: Mapping[str, str] | None = None


def _model_named(title: str, models: Sequence[type[BaseSettings]]) -> type[BaseSettings] | None:
    return next((m for m in models if m.__name__ == title), None)


def explain(exc: ValidationError, models: Sequence[type[BaseSettings]], origin: Origin | None = None) -> str:
    """A settings model's ValidationError as one line naming each environment variable, its value (secrets
    redacted), what is wrong, and where the value came from (a flag, the --config file)."""
    model = _model_named(exc.title, models)
    parts = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc", ())
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if not loc:
            parts.append(msg)
            continue
        head = str(loc[0])
        if head.upper().startswith(PREFIX):
            name = head.upper()
        elif model is not None and head in model.model_fields:
            name = env_names(model, head)[0]
        else:
            name = head
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
        source = ""
        if origin is not None and origin.flags and head in origin.flags:
            source = f" (flag {origin.flags[head]})"
        elif origin is not None and name in origin.from_file:
            source = f" (from {origin.config_path})"
        given = err.get("input")
        shown = (
            "" if isinstance(given, dict) or given is None else f"={'<redacted>' if is_secret(name) else repr(given)}"
        )
        parts.append(f"{name}{path}{shown}{source}: {msg}")
    return "; ".join(parts) + f" ({SEE_ALSO})"


@dataclass(frozen=True)
class Port:
    """A port a service is about to listen on, and the settings that name it (for the message)."""

    host: str
    port: int
    setting: str  # e.g. KVBRIDGE_GATEWAY_HTTP_PORT
    host_setting: str = "KVBRIDGE_HOST"
    flag: str = ""


def check_ports(ports: Iterable[Port]) -> None:
    """StartError (EXIT_BIND) for a port another process holds or an address this machine cannot bind, found
    by binding it for a moment before anything starts (a port of 0: only the address is checked)."""
    for p in ports:
        host = p.host.strip("[]") or "0.0.0.0"
        by = f"{p.setting}" + (f" or {p.flag}" if p.flag else "")
        try:
            infos = socket.getaddrinfo(host, p.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror:
            raise StartError(
                f"cannot start: the bind address {p.host!r} ({p.host_setting}) does not resolve; give an address "
                "of this machine (127.0.0.1, 0.0.0.0 for all)",
                EXIT_BIND,
            ) from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise StartError(_bind_message(p, exc, by), EXIT_BIND) from None


def _bind_message(p: Port, exc: OSError, by: str) -> str:
    where = f"{p.host}:{p.port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot start: port {p.port} ({by}) is in use on {p.host} by another process; stop it or choose "
            "another port (0: any free port)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot start: cannot listen on {where}: {p.host} ({p.host_setting}) is not an address of this machine; "
            "bind one of its addresses (127.0.0.1, or 0.0.0.0 for all)"
        )
    if exc.errno == errno.EACCES:
        return f"cannot start: listening on port {p.port} ({by}) needs privileges; choose a port above 1023"
    return f"cannot start: cannot listen on {where} ({by}, {p.host_setting}): {exc.strerror or exc}"


def store_unreachable(endpoints: Sequence[str], waited_s: float, last_error: object) -> StartError:
    return StartError(
        f"cannot start: etcd at {','.join(endpoints)} (KVBRIDGE_ETCD_ENDPOINTS) did not answer within {waited_s:g} s "
        f"({last_error}); start etcd or fix KVBRIDGE_ETCD_ENDPOINTS (KVBRIDGE_ETCD_START_TIMEOUT_S=0 waits for it)",
        EXIT_STORE_UNREACHABLE,
    )
