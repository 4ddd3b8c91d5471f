"""Every command README.md and docs/*.md show exists as written (issue 31: `--api-keys-file` and `kvbridge gateway`
were documented and never existed). Each `kvbridge ...` and `python -m kvbridge_services...` command line, in a
code block or an inline code span, is parsed: its command (and subcommand) must answer `--help` with exit code 0,
every `--flag` it uses must be in that help, and a subcommand's action must be one of its choices. Running `--help`
needs no engines, so every documented command is checked, including those that start engines."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_CHOICES = re.compile(r"\{([a-z0-9_,-]+)\}")


@dataclass(frozen=True)
class Documented:
    where: str  # file:line
    words: tuple[str, ...]  # the command's words, env assignments and `python -m` dropped

    @property
    def program(self) -> tuple[str, ...]:
        """What answers --help: ("kvbridge", subcommand) or ("-m", module)."""
        if self.words[0] == "-m":
            return self.words[:2]
        sub = next((w for w in self.words[1:] if not w.startswith("-")), None)
        return ("kvbridge", sub) if sub else ("kvbridge",)


def _commands_in(text: str) -> list[str]:
    """Shell lines that run kvbridge or a kvbridge_services module (pipes, &, && and ; split them)."""
    found = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip().removeprefix("$ ")
        for part in re.split(r"\s(?:&&|&|;|\|\|)\s|\s&$", line):
            segments = [s.strip() for s in re.split(r"\s\|\s", part)]
            # README's synopsis: `kvbridge status | engines ls | conversations ls|show|evict`: each segment a command.
            first = segments[0]
            if _runs_kvbridge(first):
                found.append(first)
                found.extend(f"kvbridge {s}" for s in segments[1:] if s and s.split()[0].isalpha())
    return found


def _runs_kvbridge(command: str) -> bool:
    words = [w for w in command.split() if not _ENV_ASSIGNMENT.match(w) and w != "export"]
    if not words or "…" in command:  # an ellipsis: a log line quoted in the text, not a command
        return False
    head = words[0].rsplit("/", 1)[-1]
    if head == "kvbridge":
        return len(words) > 1 and not words[1].endswith(":")
    return (
        head.startswith("python")
        and words[1:2] == ["-m"]
        and words[2:3] != []
        and (words[2].startswith("kvbridge_services"))
    )


def _parse(command: str, where: str) -> Documented:
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    words = [w for w in words if not _ENV_ASSIGNMENT.match(w) and w != "export"]
    python = words[0].rsplit("/", 1)[-1].startswith("python")
    words = words[1:] if python else ["kvbridge", *words[1:]]  # python: "-m", module, ...
    # Stop at output redirection and at `--` (what follows goes to a bench script).
    cut = next((i for i, w in enumerate(words) if w in ("--", ">", ">>", "2>&1") or w.startswith(">")), len(words))
    return Documented(where, tuple(w.strip("()[]") for w in words[:cut]))


def documented_commands() -> list[Documented]:
    commands = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for block in _FENCE.finditer(text):
            line_no = text[: block.start()].count("\n") + 2
            for offset, line in enumerate(block.group(1).splitlines()):
                commands += [_parse(c, f"{name}:{line_no + offset}") for c in _commands_in(line)]
        outside = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in _SPAN.finditer(outside):
            line_no = outside[: span.start()].count("\n") + 1
            commands += [_parse(c, f"{name}:{line_no}") for c in _commands_in(span.group(1))]
    return commands


COMMANDS = documented_commands()


@functools.cache
def help_of(program: tuple[str, ...]) -> tuple[int, str]:
    if program[0] == "-m":
        argv = [sys.executable, *program, "--help"]
    else:
        argv = [sys.executable, "-m", "kvbridge_services.cli", *program[1:], "--help"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "OTEL_"))}
    done = subprocess.run(argv, env=clean, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_the_pages_document_commands() -> None:
    programs = {c.program for c in COMMANDS}
    assert ("kvbridge", "up") in programs and ("-m", "kvbridge_services.gateway") in programs, programs
    assert len(COMMANDS) > 20, COMMANDS


@pytest.mark.parametrize("program", sorted({c.program for c in COMMANDS}), ids=" ".join)
def test_every_documented_command_exists_and_takes_its_flags(program: tuple[str, ...]) -> None:
    uses = [c for c in COMMANDS if c.program == program]
    code, text = help_of(program)
    assert code == 0, f"`{' '.join(program)} --help` failed ({code}), documented at {[u.where for u in uses]}:\n{text}"
    choices = {choice for group in _CHOICES.findall(text) for choice in group.split(",")}
    for use in uses:
        for word in use.words:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and len(flag) > 2:
                assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), (
                    f"{use.where}: `{' '.join(use.words)}` uses {flag}, which `{' '.join(program)}` does not take"
                )
        if program[0] == "kvbridge" and len(program) == 2 and choices:
            rest = [w for w in use.words[use.words.index(program[1]) + 1 :] if not w.startswith("-")]
            if rest and re.fullmatch(r"[a-z][a-z|-]*", rest[0]):
                for action in rest[0].split("|"):
                    assert action in choices, f"{use.where}: `{' '.join(use.words)}`: {action} is not one of {choices}"


def test_a_flag_named_like_a_setting_exists() -> None:
    """A bare `--flag` in the text that reads like a kvbridge setting (`--api-keys-file`: KVBRIDGE_API_KEYS_FILE)
    must be a flag of some kvbridge command: the docs once sent readers to one that never existed."""
    from kvbridge_services.common.configfile import known_names

    settings = known_names()
    helps = "\n".join(help_of(p)[1] for p in sorted({c.program for c in COMMANDS}))
    wrong = []
    for page in PAGES:
        for span in _SPAN.findall(page.read_text()):
            flag = span.split()[0] if span.startswith("--") else ""
            env = "KVBRIDGE_" + flag.removeprefix("--").replace("-", "_").upper()
            if flag and env in settings and not re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", helps):
                wrong.append(f"{page.relative_to(ROOT)}: {flag} (set {env} instead?)")
    assert not wrong, wrong
