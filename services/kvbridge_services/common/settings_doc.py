"""Every setting of a service, named as the environment names it, with its default and what it does.

One source for ``--help`` and for docs/settings.md: the settings models themselves. A field's description is
its ``Field(description=...)`` or else the comment lines right above it in the class body (the project's
habit), so a setting documented in the code is documented everywhere, and a test fails on one that is not.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

_FIELD = re.compile(r"^    (\w+)\s*:")
# A process's settings: each model with the defaults its composition root applies instead of the model's
# (or NOT_READ for a field that process takes from elsewhere).
SettingsModels = Sequence[tuple[type[BaseSettings], dict[str, str] | None]]
NOT_READ = "(not read by this process)"


@dataclass(frozen=True, slots=True)
class SettingDoc:
    env: tuple[str, ...]  # the environment names, the preferred first
    default: str
    description: str


def _comments_above_fields(model: type[BaseSettings]) -> dict[str, str]:
    """Field name -> the comment block right above its definition (a blank line or code ends a block)."""
    found: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseSettings)) or cls is BaseSettings:
            continue
        block: list[str] = []
        for line in textwrap.dedent(inspect.getsource(cls)).splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                block.append(stripped.lstrip("#").strip())
                continue
            match = _FIELD.match(line)
            if match and match.group(1) in model.model_fields:
                found[match.group(1)] = " ".join(block)
            if not line.startswith("        "):  # a continuation line of a field keeps no block either
                block = []
    return found


def _env_names(model: type[BaseSettings], name: str) -> tuple[str, ...]:
    alias = model.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        names = [str(c) for c in alias.choices if isinstance(c, str) and c.isupper()]
        if names:
            # pydantic-settings tries them in order; the stack-wide name reads best first, overrides after.
            return tuple(sorted(names, key=lambda n: (n.count("_"), n)))
    prefix = str(model.model_config.get("env_prefix", ""))
    return ((prefix + name).upper(),)


def env_names(model: type[BaseSettings], name: str) -> tuple[str, ...]:
    """The environment names of field ``name`` of ``model``, the preferred first."""
    return _env_names(model, name)


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value == "" or " " in value else value
    if isinstance(value, list | dict | tuple) and not value:
        return "empty"
    return repr(value)


def describe(model: type[BaseSettings], overrides: dict[str, str] | None = None) -> list[SettingDoc]:
    """Each field of ``model``, in definition order. ``overrides``: field name -> the default a composition
    root applies instead of the model's (e.g. a metrics port it turns on)."""
    comments = _comments_above_fields(model)
    docs = []
    for name, info in model.model_fields.items():
        default = (overrides or {}).get(name) or _default(info.get_default(call_default_factory=True))
        if default == NOT_READ:
            continue
        docs.append(SettingDoc(_env_names(model, name), default, info.description or comments.get(name, "")))
    return docs


def settings_of(models: SettingsModels) -> Iterator[SettingDoc]:
    """Every setting of a process, once (models may share a variable, e.g. the keys file)."""
    seen: set[str] = set()
    for model, overrides in models:
        for doc in describe(model, overrides):
            if doc.env[0] not in seen:
                seen.add(doc.env[0])
                yield doc


def help_text(title: str, models: SettingsModels) -> str:
    """The environment section of a service's ``--help``: every setting, its default and what it does."""
    lines = [title]
    for doc in settings_of(models):
        lines.append(f"  {' / '.join(doc.env)}  (default {doc.default})")
        if doc.description:
            lines.extend(textwrap.wrap(doc.description, width=108, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def markdown_table(models: SettingsModels) -> str:
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for doc in settings_of(models):
        names = "<br>".join(f"`{n}`" for n in doc.env)
        text = doc.description.replace("|", "\\|")
        rows.append(f"| {names} | `{doc.default}` | {text} |")
    return "\n".join(rows)
