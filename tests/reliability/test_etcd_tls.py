"""Mutual TLS to etcd: etcd runs with --client-cert-auth and certificates made by the test.

- registry and lease manager, as real processes configured only through KVBRIDGE_ETCD_CA_FILE /
  _CERT_FILE / _KEY_FILE, serve entries and leases stored in that etcd;
- clients without a certificate, with one from another CA, or in plaintext are refused by etcd, and the
  store names the TLS handshake as the cause;
- a wrong CA file makes the registry and the lease manager exit at start with that message; half-given
  settings are refused.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.config import EtcdTls, StoreSettings
from kvbridge_services.common.store.base import StoreUnavailable
from kvbridge_services.common.store.etcd import EtcdStore
from tests.fixtures.common import free_port
from tests.fixtures.control_plane_procs import _spawn, _stop, _wait_for_grpc
from tests.fixtures.etcd import EtcdServer, EtcdTlsFiles

from .conftest import BLOCK, MODEL, chain
from .pki import Pki, make_pki

pytestmark = [pytest.mark.etcd]


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, Pki, dict[str, Path]]]:
    pki = make_pki()
    files = pki.write(tmp_path)
    tls = EtcdTlsFiles(
        server_cert=files["server_cert"],
        server_key=files["server_key"],
        trusted_ca=files["ca_pem"],
        client_cert=files["client_cert"],
        client_key=files["client_key"],
    )
    server = EtcdServer(base_dir=tmp_path / "etcd", tls=tls)
    try:
        server.start()
        yield server, pki, files
    finally:
        server.close()


def _env(etcd: EtcdServer, files: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "KVBRIDGE_ETCD_ENDPOINTS": etcd.endpoint,
        "KVBRIDGE_HOST": "127.0.0.1",
        "KVBRIDGE_ETCD_CA_FILE": str(files["ca_pem"]),
        "KVBRIDGE_ETCD_CERT_FILE": str(files["client_cert"]),
        "KVBRIDGE_ETCD_KEY_FILE": str(files["client_key"]),
        "KVBRIDGE_REGISTRY_METRICS_PORT": "0",
        "KVBRIDGE_LEASE_METRICS_PORT": "0",
        **extra,
    }
    env.pop("KVBRIDGE_API_KEYS_FILE", None)
    return env


async def test_services_work_over_mtls_etcd(tls_etcd: tuple[EtcdServer, Pki, dict[str, Path]], tmp_path: Path) -> None:
    etcd, pki, files = tls_etcd
    lease_port, registry_port = free_port(), free_port()
    lease_target, registry_target = f"127.0.0.1:{lease_port}", f"127.0.0.1:{registry_port}"
    env = _env(
        etcd,
        files,
        KVBRIDGE_LEASE_PORT=str(lease_port),
        KVBRIDGE_REGISTRY_PORT=str(registry_port),
        KVBRIDGE_REGISTRY_LEASE_SERVICE_TARGET=lease_target,
    )
    procs = [
        _spawn("kvbridge_services.lease", env, tmp_path / "lease.log"),
        _spawn("kvbridge_services.registry", env, tmp_path / "registry.log"),
    ]
    try:
        _wait_for_grpc(lease_target, procs[0], tmp_path / "lease.log", timeout_s=60)
        _wait_for_grpc(registry_target, procs[1], tmp_path / "registry.log", timeout_s=60)
        async with grpc.aio.insecure_channel(lease_target) as lch, grpc.aio.insecure_channel(registry_target) as rch:
            leases, registry = lease_pb2_grpc.LeaseServiceStub(lch), registry_pb2_grpc.RegistryServiceStub(rch)
            node = None
            async with asyncio.timeout(60):  # the lease manager answers once it holds leadership (in etcd)
                while node is None:
                    try:
                        node = await leases.GrantLease(
                            lease_pb2.GrantLeaseRequest(
                                kind=lease_pb2.LEASE_KIND_NODE, engine_id="d0", ttl=Duration(seconds=60)
                            ),
                            timeout=5,
                        )
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION), exc
                        await asyncio.sleep(0.2)
            await registry.RegisterEngine(
                registry_pb2.RegisterEngineRequest(
                    engine=types_pb2.Engine(
                        engine_id="d0",
                        role=types_pb2.ENGINE_ROLE_DECODE,
                        model=MODEL,
                        http_url="http://127.0.0.1:9",
                        kv_host="127.0.0.1",
                        kv_port=9,
                        dp_size=1,
                        tp_size=1,
                        block_size=BLOCK,
                        kv_group_count=1,
                        node_lease_id=node.lease.lease_id,
                    )
                ),
                timeout=10,
            )
            lease = await leases.GrantLease(
                lease_pb2.GrantLeaseRequest(
                    kind=lease_pb2.LEASE_KIND_ENTRY,
                    tenant="acme",
                    engine_id="d0",
                    model=MODEL,
                    conversation_key="c-tls",
                    ttl=Duration(seconds=60),
                ),
                timeout=10,
            )
            key = registry_pb2.EntryKey(tenant="acme", model=MODEL, conversation_key="c-tls")
            entry = registry_pb2.Entry(
                key=key,
                engine_id="d0",
                engine_request_id="r-tls",
                block_ids=[types_pb2.BlockIds(ids=[1, 2])],
                block_size=BLOCK,
                token_count=2 * BLOCK,
                block_hashes=chain(list(range(2 * BLOCK)), "acme"),
                lease_id=lease.lease.lease_id,
                epoch=1,
            )
            await registry.RegisterEntry(registry_pb2.RegisterEntryRequest(request_id="rq", entry=entry), timeout=10)
            got = await registry.GetEntry(registry_pb2.GetEntryRequest(key=key), timeout=10)
            assert got.entry.lease_id == lease.lease.lease_id
    finally:
        for proc in procs:
            _stop(proc)
    # The state really is in the TLS etcd: read it back with a certified client.
    store = EtcdStore([etcd.endpoint], timeout=5, tls=EtcdTls(pki.ca_pem, pki.client_cert, pki.client_key))
    try:
        kvs, _ = await store.range_prefix(b"/kvbridge/v1/", keys_only=True)
        assert any(b"c-tls" in kv.key for kv in kvs), [kv.key for kv in kvs]
    finally:
        await store.close()


@pytest.mark.parametrize("who", ["no client cert", "cert from another CA", "plaintext", "wrong CA"])
async def test_etcd_refuses_clients_without_a_trusted_cert(
    tls_etcd: tuple[EtcdServer, Pki, dict[str, Path]], who: str
) -> None:
    etcd, pki, _ = tls_etcd
    tls = {
        "no client cert": EtcdTls(pki.ca_pem),
        "cert from another CA": EtcdTls(pki.ca_pem, pki.rogue_cert, pki.rogue_key),
        "plaintext": None,
        "wrong CA": EtcdTls(pki.rogue_ca_pem, pki.client_cert, pki.client_key),
    }[who]
    store = EtcdStore([etcd.endpoint], timeout=2, tls=tls)
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.get(b"/kvbridge/v1/x", timeout=2)
        if tls is not None:  # a TLS client learns why; a plaintext one just sees the connection die
            assert "TLS handshake with etcd failed" in str(info.value), info.value
    finally:
        await store.close()


@pytest.mark.parametrize("service", ["registry", "lease"])
def test_service_with_wrong_ca_fails_clearly_at_start(
    tls_etcd: tuple[EtcdServer, Pki, dict[str, Path]], tmp_path: Path, service: str
) -> None:
    etcd, _, files = tls_etcd
    port = str(free_port())
    env = _env(
        etcd,
        files,
        KVBRIDGE_REGISTRY_PORT=port,
        KVBRIDGE_LEASE_PORT=port,
        KVBRIDGE_ETCD_CA_FILE=str(files["rogue_ca_pem"]),
        KVBRIDGE_ETCD_TIMEOUT_S="2",
    )
    log = tmp_path / f"{service}.log"
    proc = _spawn(f"kvbridge_services.{service}", env, log)
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            _stop(proc)
    text = log.read_text(errors="replace")
    assert code != 0, text
    assert "TLS handshake with etcd failed" in text, text[-3000:]


def test_etcd_tls_settings_are_validated(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="together"):
        StoreSettings(etcd_ca_file=pem, etcd_cert_file=pem)
    with pytest.raises(ValueError, match="need etcd_ca_file"):
        StoreSettings(etcd_cert_file=pem, etcd_key_file=pem)
    with pytest.raises(ValueError, match="not a readable file"):
        StoreSettings(etcd_ca_file=tmp_path / "missing.pem")
    assert StoreSettings().etcd_tls() is None
    tls = StoreSettings(etcd_ca_file=pem, etcd_cert_file=pem, etcd_key_file=pem).etcd_tls()
    assert tls is not None and tls.ca_pem == pem.read_bytes() and tls.key_pem == pem.read_bytes()
    assert "BEGIN" not in repr(tls)
