"""The connector's TLS towards the control plane: PEM files from its extra config or KVBRIDGE_PEER_* env."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_connector.settings import ConnectorSettings


def test_tls_material_comes_from_extra_config_or_the_services_env(tmp_path: Path) -> None:
    for name in ("ca", "cert", "key"):
        (tmp_path / f"{name}.pem").write_bytes(name.encode())
    extra = {f"kvbridge_tls_{n}_file": str(tmp_path / f"{n}.pem") for n in ("ca", "cert", "key")}
    s = ConnectorSettings.from_extra_config(extra, env={})
    assert (s.tls_ca, s.tls_cert, s.tls_key) == (b"ca", b"cert", b"key")
    s = ConnectorSettings.from_extra_config({}, env={"KVBRIDGE_PEER_CA_FILE": str(tmp_path / "ca.pem")})
    assert (s.tls_ca, s.tls_cert, s.tls_key) == (b"ca", None, None)
    assert ConnectorSettings.from_extra_config({}, env={}).tls_ca is None
    assert "b'key'" not in repr(s)  # key material stays out of logs


def test_bad_tls_settings_fail_at_start(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_bytes(b"x")
    with pytest.raises(ValueError, match="together"):
        ConnectorSettings.from_extra_config(
            {"kvbridge_tls_ca_file": str(pem), "kvbridge_tls_cert_file": str(pem)}, env={}
        )
    with pytest.raises(ValueError, match="need kvbridge_tls_ca_file"):
        ConnectorSettings.from_extra_config(
            {"kvbridge_tls_cert_file": str(pem), "kvbridge_tls_key_file": str(pem)}, env={}
        )
    with pytest.raises(ValueError, match="kvbridge_tls_ca_file"):
        ConnectorSettings.from_extra_config({"kvbridge_tls_ca_file": str(tmp_path / "missing.pem")}, env={})
