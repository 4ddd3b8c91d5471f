"""docs/settings.md: every setting of the three services, from the same models their ``--help`` is made from.

``python -m kvbridge_services.settings_reference > docs/settings.md``; a test fails when the page is stale.
``python -m kvbridge_services.settings_reference --env-names > /tmp/env_names.py`` then move it to
``services/kvbridge_services/common/env_names.py``:
the catalog of every service's environment names, against which each service checks the ``KVBRIDGE_*``
environment and a ``--config`` file (a service cannot import the others' models); a test fails when it is stale.
"""

from __future__ import annotations

import sys

from kvbridge_services.common.settings_doc import SettingsModels, env_names, markdown_table
from kvbridge_services.common.telemetry import TelemetrySettings
from kvbridge_services.gateway.__main__ import SETTINGS as GATEWAY
from kvbridge_services.lease.__main__ import SETTINGS as LEASE
from kvbridge_services.registry.__main__ import SETTINGS as REGISTRY

SERVICES: tuple[tuple[str, str, SettingsModels], ...] = (
    ("Lease manager", "python -m kvbridge_services.lease", LEASE),
    ("Registry", "python -m kvbridge_services.registry", REGISTRY),
    ("Gateway", "python -m kvbridge_services.gateway", GATEWAY),
)

_INTRO = """# Settings

Every setting of the three services, as the environment names it, with its default and what it does. Generated
from the settings models (`python -m kvbridge_services.settings_reference > docs/settings.md`; a test fails when
this page is stale), the same source as each service's `--help`. `KVBRIDGE_*` settings without a service prefix
are shared: one keys file (`KVBRIDGE_API_KEYS_FILE`), one service key (`KVBRIDGE_API_KEY`) and one deployment
secret (`KVBRIDGE_HASH_SECRET`) configure a whole stack (docs/security.md). `kvbridge up` runs all three in one
process on these settings. The vLLM connector's settings (`kv_connector_extra_config`) are in docs/connector.md.

Telemetry, in every service: `OTEL_EXPORTER_OTLP_ENDPOINT` (OTLP/gRPC collector; unset: tracing off),
`OTEL_SERVICE_NAME` and the other standard `OTEL_*` variables, and `KVBRIDGE_TELEMETRY_HASH_KEY_HEX` (the key
hashing tenant and conversation span attributes; share it across services).

## A configuration file

Every service and `kvbridge up` take `--config FILE`: a YAML mapping from the names below to values, the same
names as the environment. A variable set in the environment overrides the file; a flag overrides both. Lists and
mappings may be written as YAML (`KVBRIDGE_ETCD_ENDPOINTS: [etcd-1:2379, etcd-2:2379]`,
`KVBRIDGE_GATEWAY_PREFILL_ENGINES: [{url: "http://p:8000"}]`) or as the environment's string.

```yaml
# kvbridge.yaml
KVBRIDGE_ETCD_ENDPOINTS: [127.0.0.1:2379]
KVBRIDGE_GATEWAY_HTTP_PORT: 8080
KVBRIDGE_LEASE_DEFAULT_TTL_S: 60
KVBRIDGE_LOG_LEVEL: INFO
```

`kvbridge config check [--config FILE]` validates the file and the environment for all three services and
prints the effective settings (secrets redacted), without starting anything.

A name no service reads is refused, in the file and in the environment, with the closest valid name: a typo
is never silently ignored. `KVBRIDGE_*` variables read by other kvbridge tools (the CLI's
`KVBRIDGE_REGISTRY_ADDRESS`/`KVBRIDGE_LEASE_ADDRESS`, `kvbridge up --engines`' `KVBRIDGE_ENGINE_*` and
`KVBRIDGE_*_GPUS`, the connector's `KVBRIDGE_ALLOW_UNSUPPORTED_VLLM`, `KVBRIDGE_TEST_WORKERS`, the SDK examples'
and deploy/'s names; the list is `OTHER_ENV_NAMES` in `kvbridge_services/common/configfile.py`) are accepted in
the environment.

## Failures to start

A service or `kvbridge up` that cannot start prints one line on stderr naming the setting or port and the fix,
and exits with:

| exit code | cause |
| --- | --- |
| 2 | configuration: a bad value, an unknown `KVBRIDGE_*` name, a bad `--config` file or flag, a refused combination |
| 3 | a port cannot be bound: in use by another process, or an address that is not this machine's |
| 4 | etcd (`KVBRIDGE_ETCD_ENDPOINTS`) did not answer within `KVBRIDGE_ETCD_START_TIMEOUT_S` |
| 1 | anything else (a damaged or locked `--data-dir`: `kvbridge store verify`) |
"""


def markdown() -> str:
    sections = [_INTRO]
    for title, command, models in SERVICES:
        sections.append(f"## {title} (`{command}`)\n\n{markdown_table(models)}\n")
    return "\n".join(sections)


def all_env_names() -> list[str]:
    """Every environment name any service reads (each model's every field, whichever process reads it)."""
    names: set[str] = set()
    for _, _, models in SERVICES:
        for model, _ in models:
            for field in model.model_fields:
                names.update(env_names(model, field))
    for field in TelemetrySettings.model_fields:
        names.update(env_names(TelemetrySettings, field))
    return sorted(names)


def env_names_module() -> str:
    lines = "\n".join(f'        "{name}",' for name in all_env_names())
    return (
        '"""Every environment name a kvbridge service reads. Generated (do not edit): ``python -m\n'
        "kvbridge_services.settings_reference --env-names > /tmp/env_names.py``, then moved here.\n"
        '"""\n\n'
        "SERVICE_ENV_NAMES = frozenset(\n    {\n" + lines + "\n    }\n)\n"
    )


if __name__ == "__main__":
    print(env_names_module() if sys.argv[1:] == ["--env-names"] else markdown(), end="")
