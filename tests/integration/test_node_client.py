"""The Node.js client example (clients/node/client.js, @grpc/grpc-js) against an in-process stack.

The stack (tests/fixtures/gateway_stack.py: lease manager, registry, gateway, engine simulators; API keys on)
holds two entries of tenant acme with the same hash chain under two conversations. The Node client then does a keyed
lookup of the second (it must hit that conversation, not the first: snake_case fields kept), a KeepAlive
round on the 62-bit lease id the lookup returned (sent back exactly: ids as strings), and a malformed lookup
whose ErrorInfo it decodes from grpc-status-details-bin; the chain it sends is `kvbridge hash`'s JSON
(--hashes-file). --help, `npm start` without arguments and without a server answer one line each, never a stack
trace. Node and clients/node/node_modules (scripts/install) are required: a missing one fails the test, it does
not skip it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from tests.fixtures.common import free_port
from tests.fixtures.gateway_stack import BLOCK, LONG, MODEL, SECRET_HEX, SERVICE_KEY, Stack, running_stack, turn

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "node"
ACME_KEY = "key-acme"  # the client runs as tenant acme


def node_binary() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            "node not found: the Node.js client example needs Node.js >= 20 (apt-get install nodejs npm)", pytrace=False
        )
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules missing: run scripts/install (npm ci in clients/node)", pytrace=False)
    return node


def run_client_sync(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [node, str(CLIENT_DIR / "client.js"), *args], cwd=CLIENT_DIR, capture_output=True, text=True, timeout=60
    )


async def run_client(node: str, *args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        node,
        str(CLIENT_DIR / "client.js"),
        *args,
        cwd=CLIENT_DIR,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


async def register(stack: Stack, conv: str, chain: list[bytes]) -> registry_pb2.Entry:
    """An entry of tenant acme on engine d0 under ``conv``, as an engine's connector registers it (gateway role)."""
    assert stack.registry is not None and stack.lease is not None
    md = (("authorization", f"Bearer {SERVICE_KEY}"),)
    async with grpc.aio.insecure_channel(stack.lease.address) as channel:
        granted = await lease_pb2_grpc.LeaseServiceStub(channel).GrantLease(
            lease_pb2.GrantLeaseRequest(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant="acme",
                engine_id="d0",
                model=MODEL,
                conversation_key=conv,
                retained_tokens=len(chain) * BLOCK,
                ttl=duration_pb2.Duration(seconds=60),
            ),
            metadata=md,
            timeout=5,
        )
    entry = registry_pb2.Entry(
        key=registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key=conv),
        engine_id="d0",
        engine_request_id=f"req-{conv}",
        block_ids=[types_pb2.BlockIds(ids=list(range(len(chain))))],
        block_size=BLOCK,
        token_count=len(chain) * BLOCK,
        block_hashes=chain,
        lease_id=granted.lease.lease_id,
        epoch=1,
    )
    async with grpc.aio.insecure_channel(stack.registry.address) as channel:
        await registry_pb2_grpc.RegistryServiceStub(channel).RegisterEntry(
            registry_pb2.RegisterEntryRequest(request_id=f"rq-{conv}", entry=entry), metadata=md, timeout=5
        )
    return entry


def kvbridge_hash(tmp_path: Path, tokens: list[int]) -> Path:
    """`kvbridge hash`'s JSON for tenant acme's ``tokens`` (no client salt), written where --hashes-file reads it."""
    args = ["hash", "--tenant", "acme", "--model", MODEL, "--block-size", str(BLOCK), "--tokens", json.dumps(tokens)]
    hashed = subprocess.run(
        [sys.executable, "-m", "kvbridge_services.cli", *args],
        env={**os.environ, "KVBRIDGE_HASH_SECRET": SECRET_HEX},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert hashed.returncode == 0, hashed.stderr
    path = tmp_path / "chain.json"
    path.write_text(hashed.stdout)
    return path


async def test_node_client_lookup_keepalive_and_error_info(tmp_path: Path) -> None:
    node = node_binary()
    tokens = list(range(8 * BLOCK))
    chain = hashchain.chain(bytes.fromhex(SECRET_HEX), "acme", MODEL, "", BLOCK, tokens)
    chain_file = kvbridge_hash(tmp_path, tokens)  # the chain as a Node user gets it (README.md)
    assert json.loads(chain_file.read_text())["hashes"] == [h.hex() for h in chain]
    async with running_stack(secure_control_plane=True) as stack:
        assert stack.registry is not None and stack.lease is not None
        await turn(stack, [{"role": "user", "content": LONG}], conv="warm-up")  # engines p0/d0 registered
        await register(stack, "conv-a", chain)
        entry = await register(stack, "conv-b", chain)  # the same content under another conversation
        result = await run_client(
            node,
            "--registry",
            stack.registry.address,
            "--lease",
            stack.lease.address,
            "--api-key",
            ACME_KEY,
            "--tenant",
            "acme",
            "--model",
            MODEL,
            "--conversation",
            "conv-b",
            "--block-size",
            str(BLOCK),
            "--hashes-file",
            str(chain_file),
        )

    lookup = result["lookup"]
    assert lookup["verdict"] == "LOOKUP_VERDICT_HIT"
    assert lookup["conversation_key"] == "conv-b"  # keyed: not conv-a's entry with the same content
    assert lookup["verified_tokens"] == len(tokens)
    assert lookup["engine_id"] == "d0"
    assert lookup["lease_id"] == str(entry.lease_id)  # a 62-bit id, exact
    assert result["keepalive"] == [
        {"lease_id": str(entry.lease_id), "alive": True, "error": "ERROR_REASON_UNSPECIFIED"}
    ]
    error = result["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["info"] == {
        "reason": "INVALID_FIELD",
        "domain": "kvbridge.dev",
        "metadata": {"field": "block_hashes_packed"},
    }


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.startswith("kvbridge node client: "), text
    assert "    at " not in text  # no stack trace
    return text


def test_node_client_help_and_usage_errors_are_one_line() -> None:
    node = node_binary()
    done = run_client_sync(node, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: npm start -- --model MODEL"), done
    assert "--hashes-file" in done.stdout and done.stderr == ""
    done = run_client_sync(node)  # what `npm start` with no arguments runs
    assert done.returncode == 2 and done.stdout == ""
    assert "missing --model, --conversation, --block-size" in _one_line(done.stderr)
    done = run_client_sync(node, "--bogus")
    assert done.returncode == 2 and "'--bogus'" in _one_line(done.stderr)
    done = run_client_sync(node, "--model", "m", "--conversation", "c", "--block-size", "16", "--hashes", "abc")
    assert done.returncode == 2 and "32 hex digits" in _one_line(done.stderr)


def test_node_client_without_a_server_is_one_line() -> None:
    """`npm start` with nothing listening: the failed call and what to start, exit 1, no stack trace."""
    node = node_binary()
    registry, lease = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ("--registry", registry, "--lease", lease, "--model", "m", "--conversation", "c", "--block-size", "16")
    done = run_client_sync(node, *args)
    assert done.returncode == 1 and done.stdout == ""
    line = _one_line(done.stderr)
    assert line.startswith("kvbridge node client: LookupEntry failed: UNAVAILABLE: ") and registry in line
    assert "`kvbridge up` starts both" in line


def test_shipped_google_rpc_protos_are_the_pinned_googleapis_ones() -> None:
    """proto/google/rpc is a verbatim copy of googleapis-common-protos' files (requirements): no silent drift."""
    import google.rpc

    package_dir = Path(google.rpc.__path__[0])
    for name in ("status.proto", "error_details.proto"):
        shipped = (ROOT / "proto" / "google" / "rpc" / name).read_text()
        assert shipped == (package_dir / name).read_text(), f"re-copy {name} from googleapis-common-protos"
