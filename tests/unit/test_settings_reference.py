"""Every setting is documented: in its service's --help and in docs/settings.md, both made from the settings
models, and none without a description (a new field without one fails here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_services.common.settings_doc import describe
from kvbridge_services.settings_reference import SERVICES, markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("title", "command", "models"), SERVICES, ids=[s[0] for s in SERVICES])
def test_every_setting_has_a_description_and_is_in_the_services_help(title: str, command: str, models: object) -> None:
    help_text = subprocess.run(
        [sys.executable, *command.split()[1:], "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for model, overrides in models:  # type: ignore[attr-defined]
        for doc in describe(model, overrides):
            assert doc.description, (
                f"{doc.env[0]} ({model.__name__}) has no description: add a comment or Field(description=)"
            )
            for name in doc.env:
                assert name in help_text, f"{name} missing from `{command} --help`"


def test_docs_settings_page_is_generated_from_the_models() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == markdown(), (
        "docs/settings.md is stale: python -m kvbridge_services.settings_reference > docs/settings.md"
    )


def test_an_undescribed_field_is_caught() -> None:
    from pydantic_settings import BaseSettings

    class Probe(BaseSettings):
        # Described by its comment.
        commented: int = 1
        bare: int = 2

    docs = {d.env[0]: d.description for d in describe(Probe)}
    assert docs == {"COMMENTED": "Described by its comment.", "BARE": ""}


def test_the_env_names_catalog_is_generated_from_the_models() -> None:
    from kvbridge_services.settings_reference import env_names_module

    path = ROOT / "services" / "kvbridge_services" / "common" / "env_names.py"
    assert path.read_text() == env_names_module(), (
        "services/kvbridge_services/common/env_names.py is stale: python -m kvbridge_services.settings_reference "
        "--env-names > /tmp/env_names.py && mv /tmp/env_names.py services/kvbridge_services/common/env_names.py"
    )
