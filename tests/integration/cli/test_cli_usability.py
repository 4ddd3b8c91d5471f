"""The CLI a new user meets (issue 31): --version, help on every flag, aligned tables with names instead of enum
numbers, errors that say what is missing, a node lease revoked only when asked twice, `kvbridge config check`."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbridge.lease.v1 import lease_pb2
from kvbridge.sdk import ClientOptions, LeaseClient
from kvbridge.types.v1 import types_pb2
from kvbridge_services.cli import _emit, build_parser
from kvbridge_services.stack import Stack, StackConfig


def _kvbridge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvbridge_services.cli", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_version() -> None:
    done = _kvbridge("--version")
    assert done.returncode == 0 and done.stdout.startswith("kvbridge 0."), done


def _parsers(parser: argparse.ArgumentParser, name: str = "kvbridge") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, f"{name} {sub_name}")
    return found


def test_every_flag_and_argument_has_help() -> None:
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in _parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert not missing, missing


def test_tables_are_aligned_and_show_names_not_enum_values(capsys: pytest.CaptureFixture[str]) -> None:
    engines = [
        types_pb2.Engine(engine_id="d", role=types_pb2.ENGINE_ROLE_DECODE, model="m", kv_host="h"),
        types_pb2.Engine(
            engine_id="a-very-long-engine-identifier-that-overflowed-eighteen-columns",
            role=types_pb2.ENGINE_ROLE_PREFILL,
            model="meta-llama/Llama-3.1-8B-Instruct",
            kv_host="10.0.0.1",
        ),
    ]
    columns = [("ENGINE", "engine_id"), ("ROLE", "role"), ("MODEL", "model"), ("KV", "kv_host")]
    _emit(argparse.Namespace(json=False), engines, columns)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    starts = [lines[0].index(title) for title, _ in columns]
    for line, engine, role in zip(lines[1:], engines, ("decode", "prefill"), strict=True):
        assert [line.index(cell, start) for cell, start in zip((engine.engine_id, role), starts, strict=False)] == (
            starts[:2]
        ), lines
        assert line[starts[2] :].startswith(engine.model) and line[starts[3] :].startswith(engine.kv_host)
    assert "ENGINE_ROLE" not in "\n".join(lines) and all(line == line.rstrip() for line in lines)


@pytest.mark.parametrize("action", ["show", "evict"])
def test_conversations_show_and_evict_say_what_is_missing(action: str) -> None:
    done = _kvbridge("conversations", action, "conv-1")
    assert done.returncode == 2 and "needs --model MODEL" in done.stderr and "--tenant" in done.stderr
    done = _kvbridge("conversations", action)
    assert done.returncode == 2 and "needs a conversation KEY and --model MODEL" in done.stderr


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = Stack(StackConfig(registry_port=0, lease_port=0, gateway=None))
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def test_a_node_lease_is_revoked_only_with_a_yes(stack: Stack) -> None:
    assert stack.lease is not None and stack.registry is not None
    lease_at = stack.lease.address
    async with LeaseClient(lease_at, ClientOptions(timeout_s=5)) as leases:
        node = (await leases.grant(kind=lease_pb2.LEASE_KIND_NODE, engine_id="decode-0", ttl_s=60)).lease
        entry = (
            await leases.grant(
                kind=lease_pb2.LEASE_KIND_ENTRY, tenant="acme", engine_id="decode-0", model="m", conversation_key="c"
            )
        ).lease
        args = ("--lease", lease_at, "--registry", stack.registry.address)
        listed = await asyncio.to_thread(_kvbridge, "leases", "ls", "--tenant", "acme", *args)
        assert listed.returncode == 0, listed.stderr
        assert "LEASE_KIND" not in listed.stdout and " entry " in listed.stdout

        refused = await asyncio.to_thread(_kvbridge, "leases", "revoke", str(node.lease_id), *args)
        assert refused.returncode == 2, refused
        assert "engine decode-0's node lease" in refused.stderr and "add --yes" in refused.stderr
        assert (await leases.get(node.lease_id)).lease_id == node.lease_id  # still there

        plain = await asyncio.to_thread(_kvbridge, "leases", "revoke", str(entry.lease_id), *args)
        assert plain.returncode == 0 and f"revoked lease {entry.lease_id}" in plain.stdout, plain

        done = await asyncio.to_thread(_kvbridge, "leases", "revoke", str(node.lease_id), "--yes", *args)
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith("kvbridge: warning: lease") and f"revoked lease {node.lease_id}" in done.stdout


def test_config_check_prints_the_effective_settings_with_secrets_redacted(tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text(
        "KVBRIDGE_GATEWAY_HTTP_PORT: 8181\nKVBRIDGE_HASH_SECRET: 00112233445566778899aabbccddeeff\n"
        "KVBRIDGE_ETCD_ENDPOINTS: [e1:2379, e2:2379]\n"
    )
    done = _kvbridge("config", "check", "--config", str(config), env={"KVBRIDGE_LEASE_DEFAULT_TTL_S": "30"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "00112233445566778899aabbccddeeff" not in out and "<redacted>" in out
    rows = {tuple(line.split()[:3]) for line in out.splitlines() if line.startswith("KVBRIDGE_")}
    assert ("KVBRIDGE_GATEWAY_HTTP_PORT", "8181", str(config)) in rows
    assert ("KVBRIDGE_LEASE_DEFAULT_TTL_S", "30.0", "environment") in rows
    assert ("KVBRIDGE_ETCD_ENDPOINTS", '["e1:2379","e2:2379"]', str(config)) in rows
    assert ("KVBRIDGE_REGISTRY_PORT", "50051", "default") in rows


def test_config_check_names_every_problem_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.yaml"
    config.write_text("KVBRIDGE_GATEWAY_HTTP_PORT: 99999\nKVBRIDGE_LEASE_MIN_TTL_S: -1\n")
    done = _kvbridge("config", "check", "--config", str(config))
    assert done.returncode == 2, done
    lines = done.stderr.splitlines()
    assert any("Gateway: KVBRIDGE_GATEWAY_HTTP_PORT=" in line for line in lines), lines
    assert any("Lease manager: KVBRIDGE_LEASE_MIN_TTL_S=" in line for line in lines), lines
    config.write_text("KVBRIDGE_GATEWAY_HTTP_PROT: 8080\n")
    done = _kvbridge("config", "check", "--config", str(config))
    assert done.returncode == 2 and "did you mean KVBRIDGE_GATEWAY_HTTP_PORT?" in done.stderr, done
