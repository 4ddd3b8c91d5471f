"""`kvbridge up --engines` keeps the deployment secret off vLLM's command line (issue 30, item 8): the launcher
passes the connector's credentials in the engine's environment, which the connector reads when its extra config
lacks them; the extra-config form still works."""

from __future__ import annotations

import json
from pathlib import Path

from kvbridge_connector.settings import ConnectorSettings
from kvbridge_services.devengines.launcher import (
    engine_command,
    engine_env,
    kvbridge_connector_overrides,
    pd_specs,
)

SECRET = "00112233445566778899aabbccddeeff"
API_KEY = "kvb_engine_key_0001"


def test_credentials_go_in_the_environment_not_the_command_line(tmp_path: Path) -> None:
    extra = {
        "kvbridge_registry": "127.0.0.1:1",
        "kvbridge_lease": "127.0.0.1:2",
        "kvbridge_hash_secret": SECRET,
        "kvbridge_api_key": API_KEY,
    }
    _, decode = pd_specs(tmp_path, tmp_path, decode_overrides=kvbridge_connector_overrides(extra))
    command = engine_command(decode, 8000, "d0")
    assert not [arg for arg in command if SECRET in arg or API_KEY in arg]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    extra_seen = config["kv_connector_extra_config"]
    assert extra_seen["kvbridge_registry"] == "127.0.0.1:1" and "kvbridge_hash_secret" not in extra_seen
    env = engine_env(decode, 5600)
    assert env["KVBRIDGE_HASH_SECRET"] == SECRET and env["KVBRIDGE_API_KEY"] == API_KEY
    # What the engine's connector makes of them: the same secret and key as before.
    settings = ConnectorSettings.from_extra_config(extra_seen, env=env)
    assert settings.hash_secret == bytes.fromhex(SECRET) and settings.api_key == API_KEY


def test_the_extra_config_form_still_works() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"kvbridge_registry": "127.0.0.1:1", "kvbridge_hash_secret": SECRET}, env={}
    )
    assert settings.hash_secret == bytes.fromhex(SECRET)
