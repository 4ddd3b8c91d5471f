"""docs/settings.md: every setting of the three services, from the same models their ``--help`` is made from.

``python -m kvbridge_services.settings_reference > docs/settings.md``; a test fails when the page is stale.
"""

from __future__ import annotations

from kvbridge_services.common.settings_doc import SettingsModels, markdown_table
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
"""


def markdown() -> str:
    sections = [_INTRO]
    for title, command, models in SERVICES:
        sections.append(f"## {title} (`{command}`)\n\n{markdown_table(models)}\n")
    return "\n".join(sections)


if __name__ == "__main__":
    print(markdown(), end="")
