"""Every ```python block of docs/sdk.md runs, unchanged, against a live stack with simulated engines.

The blocks read their addresses from KVBRIDGE_* environment variables (documented on the page); this
test sets them to the in-process stack, plus a TLS registry with a throwaway CA for the TLS block.
Each block runs in a worker thread (blocks call ``asyncio.run`` or block), as a user's script would.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbridge_services.common.auth import Authenticator
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.fixtures.gateway_stack import KEYS, MODEL, OPERATOR_KEY, OPERATOR_PRINCIPAL, Stack
from tests.reliability.pki import make_pki

from .conftest import ACME_KEY

DOC = Path(__file__).resolve().parents[3] / "docs" / "sdk.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
async def tls_registry(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    pki = make_pki()
    files = pki.write(tmp_path)
    server = ServerSettings(shutdown_grace_s=0, tls_cert_file=files["server_cert"], tls_key_file=files["server_key"])
    store = MemoryStore()
    auth = Authenticator({**KEYS, OPERATOR_KEY: OPERATOR_PRINCIPAL})
    app = RegistryApp(store, settings=RegistrySettings(port=0), server_settings=server, auth=auth)
    await app.start()
    yield app.address, files["ca_pem"]
    await app.stop(0.1)
    await store.close()


def test_doc_has_the_promised_examples() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 7
    joined = "\n".join(blocks)
    for needle in (
        "kvbridge.sdk.sync",
        "conversation(",
        "stream_chat",
        "except InvalidArgument",
        "root_certificates",
        "max_attempts",
        "Heartbeater",
    ):
        assert needle in joined, needle


async def test_every_python_block_runs(
    sdk_stack: Stack, tls_registry: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sdk_stack.lease is not None and sdk_stack.registry is not None
    tls_address, ca_file = tls_registry
    env = {
        "KVBRIDGE_GATEWAY": sdk_stack.gateway.grpc_address,
        "KVBRIDGE_LEASE": sdk_stack.lease.address,
        "KVBRIDGE_REGISTRY": sdk_stack.registry.address,
        "KVBRIDGE_API_KEY": ACME_KEY,
        "KVBRIDGE_OPERATOR_API_KEY": OPERATOR_KEY,
        "KVBRIDGE_MODEL": MODEL,
        "KVBRIDGE_CA_FILE": str(ca_file),
        "KVBRIDGE_TLS_REGISTRY": tls_address,
        "KVBRIDGE_TLS_SERVER_NAME": "localhost",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for i, code in enumerate(python_blocks()):
        out = io.StringIO()

        def run(source: str = code, index: int = i, sink: io.StringIO = out) -> None:
            with contextlib.redirect_stdout(sink):
                exec(compile(source, f"docs/sdk.md[python block {index}]", "exec"), {"__name__": "__main__"})

        await asyncio.wait_for(asyncio.to_thread(run), 60)
        assert out.getvalue().strip(), f"block {i} printed nothing"
