"""Mutual TLS between the services: gateway → registry and lease manager, registry → lease manager.

Certificates are made by the test (tests/reliability/pki.py). The lease manager and registry serve
mutual TLS; a gateway with a certificate from the right CA gets verified reuse, its compatibility-mode
registrations land, and the registry revokes superseded leases at the lease manager over mTLS. A gateway
without a client certificate is refused by both (it still answers, recomputing), and the settings that
configure all this are validated at start.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvbridge.errors import NotFound
from kvbridge.sdk import ClientOptions, LeaseClient, RegistryClient
from kvbridge_services.common.config import PeerTlsSettings, ServerSettings
from tests.fixtures.gateway_stack import LONG, MODEL, running_stack, turn

from .pki import make_pki


def _tls(tmp_path: Path) -> tuple[ServerSettings, PeerTlsSettings, PeerTlsSettings, ClientOptions]:
    pki = make_pki()
    files = pki.write(tmp_path)
    server = ServerSettings(
        tls_cert_file=files["server_cert"], tls_key_file=files["server_key"], tls_client_ca_file=files["ca_pem"]
    )
    peer = PeerTlsSettings(
        ca_file=files["ca_pem"], cert_file=files["client_cert"], key_file=files["client_key"], server_name="localhost"
    )
    no_cert = PeerTlsSettings(ca_file=files["ca_pem"], server_name="localhost")
    sdk = ClientOptions(
        root_certificates=pki.ca_pem,
        client_certificate_chain=pki.client_cert,
        client_private_key=pki.client_key,
        tls_server_name="localhost",
        timeout_s=3,
    )
    return server, peer, no_cert, sdk


async def test_services_talk_mutual_tls_end_to_end(tmp_path: Path) -> None:
    server, peer, _, sdk = _tls(tmp_path)
    async with running_stack(control_tls=server, registry_peer_tls=peer, gateway_peer_tls=peer) as stack:
        assert stack.registry is not None and stack.lease is not None
        msgs = [{"role": "user", "content": LONG}]
        answer, first = await turn(stack, msgs, conv="mtls")
        async with RegistryClient(stack.registry.address, sdk) as reg, LeaseClient(stack.lease.address, sdk) as leases:
            entry = await reg.get_entry("acme", MODEL, "mtls")  # registered by the gateway over mTLS
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
            _, second = await turn(stack, msgs, conv="mtls")
            assert first.startswith("miss") and second.startswith("hit;"), (first, second)
            # Turn 2's registration superseded turn 1's entry; the registry revoked the old lease over mTLS.
            assert (await reg.get_entry("acme", MODEL, "mtls")).epoch > entry.epoch
            for _ in range(50):  # the registry revokes in the background
                try:
                    await leases.get(entry.lease_id)
                except NotFound:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the superseded lease was not revoked")


async def test_a_gateway_without_a_client_certificate_is_refused_and_recomputes(tmp_path: Path) -> None:
    server, peer, no_cert, sdk = _tls(tmp_path)
    async with running_stack(control_tls=server, registry_peer_tls=peer, gateway_peer_tls=no_cert) as stack:
        assert stack.registry is not None
        msgs = [{"role": "user", "content": LONG}]
        answer, _ = await turn(stack, msgs, conv="no-cert")
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        _, second = await turn(stack, msgs, conv="no-cert")
        assert second.startswith("declined:registry_unavailable"), second  # answered, without reuse
        async with RegistryClient(stack.registry.address, sdk) as reg:
            with pytest.raises(NotFound):
                await reg.get_entry("acme", MODEL, "no-cert")  # its registrations never got through


def test_peer_tls_settings_are_validated(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"not checked here")
    with pytest.raises(ValueError, match="together"):
        PeerTlsSettings(ca_file=ca, cert_file=ca)
    with pytest.raises(ValueError, match="need ca_file"):
        PeerTlsSettings(cert_file=ca, key_file=ca)
    with pytest.raises(ValueError, match="not a readable file"):
        PeerTlsSettings(ca_file=tmp_path / "missing.pem")
