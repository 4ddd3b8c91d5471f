"""The one rule for a missing part (tests/fixtures/common.py): the test fails with the install hint, never skips."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.fixtures.common import consecutive_free_ports, require, require_etcd_binary


def test_a_missing_module_fails_the_test_naming_it_and_how_to_install_it() -> None:
    assert require("json", "unused") is json
    with pytest.raises(pytest.fail.Exception, match=r"no_such_module_kvb .*is missing: run the installer"):
        require("no_such_module_kvb", "run the installer")


def test_a_missing_etcd_binary_fails_even_without_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("ETCD_BIN", str(tmp_path / "no-etcd"))
    with pytest.raises(pytest.fail.Exception, match="the etcd binary is missing"):
        require_etcd_binary()


def test_consecutive_free_ports_are_free_together() -> None:
    base = consecutive_free_ports(3)
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for offset, sock in enumerate((a, b, c)):
            sock.bind(("127.0.0.1", base + offset))
