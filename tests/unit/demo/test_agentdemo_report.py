"""The README demo's report (kvbridge_services.agentdemo): the reuse header parsed, the keys file it writes
(loaded by the real Authenticator), the table and the PNG. The engine run itself: tests/e2e/test_demo_agent.py."""

from __future__ import annotations

from pathlib import Path

from kvbridge_services.agentdemo import (
    DemoReport,
    TurnReport,
    format_table,
    parse_reuse_header,
    write_keys_file,
    write_png,
)
from kvbridge_services.common.auth import Authenticator


def test_reuse_header_gives_the_verdict_and_the_tokens_pulled_only_for_a_hit() -> None:
    assert parse_reuse_header("hit;tokens=736") == ("hit", 736)
    assert parse_reuse_header("miss;tokens=0") == ("miss", 0)
    assert parse_reuse_header("declined:mismatch;tokens=64") == ("declined:mismatch", 0)
    assert parse_reuse_header("") == ("", 0)


def test_keys_file_holds_one_service_key_and_a_tenant_key_each(tmp_path: Path) -> None:
    path, service, tenants = write_keys_file(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    auth = Authenticator.from_file(path)
    assert set(auth.authenticate_key(service).roles) == {"gateway", "engine", "operator"}
    for tenant, key in tenants.items():
        principal = auth.authenticate_key(key)
        assert principal.tenant == tenant and set(principal.roles) == {"tenant"}
    assert sorted(tenants) == ["acme", "globex"] and len({service, *tenants.values()}) == 3


def _report() -> DemoReport:
    return DemoReport(
        turns=[
            TurnReport("1 first turn", "acme", "trip-1", 725, "miss", 0, 1500.0, 1400.0, "miss", "miss"),
            TurnReport("2 after search_flights", "acme", "trip-1", 938, "hit", 736, 500.0, 2000.0, "miss", "hit", 9, 5),
        ],
        model_shape={"num_layers": 8, "hidden_size": 768},
    )


def test_table_and_json_carry_both_ttfts_and_their_ratio() -> None:
    report = _report()
    table = format_table(report)
    assert "2 after search_flights" in table and "4.00x" in table and "736" in table
    rows = report.to_json()["turns"]
    assert [r["ratio"] for r in rows] == [0.93, 4.0]


def test_png_is_written(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "ttft.png"
    write_png(_report(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
