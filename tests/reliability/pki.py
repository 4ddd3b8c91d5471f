"""Test PKI made with `cryptography`: a CA, a server cert (localhost / 127.0.0.1), a client cert, and a client
cert from another ("rogue") CA. Used by the service mTLS and etcd mTLS tests."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pki:
    ca_pem: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    rogue_cert: bytes  # signed by another CA
    rogue_key: bytes
    rogue_ca_pem: bytes  # that other CA

    def write(self, directory: Path) -> dict[str, Path]:
        """Every PEM as a file in ``directory``, by field name."""
        out = {}
        for name in self.__dataclass_fields__:
            out[name] = directory / f"{name}.pem"
            out[name].write_bytes(getattr(self, name))
        return out


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    san: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki() -> Pki:
    pem = serialization.Encoding.PEM
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("kvbridge-test-ca", ca_key, "kvbridge-test-ca", ca_key, ca=True)
    server_key, client_key, rogue_key = _key(), _key(), _key()
    server = _cert("localhost", server_key, "kvbridge-test-ca", ca_key, ca=False, san=True)
    client = _cert("gateway", client_key, "kvbridge-test-ca", ca_key, ca=False)
    rogue = _cert("gateway", rogue_key, "rogue-ca", rogue_ca_key, ca=False)
    rogue_ca = _cert("rogue-ca", rogue_ca_key, "rogue-ca", rogue_ca_key, ca=True)
    return Pki(
        ca.public_bytes(pem),
        server.public_bytes(pem),
        _pem_key(server_key),
        client.public_bytes(pem),
        _pem_key(client_key),
        rogue.public_bytes(pem),
        _pem_key(rogue_key),
        rogue_ca.public_bytes(pem),
    )
