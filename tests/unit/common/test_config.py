import pytest
from pydantic import ValidationError

from kvbridge_services.common.config import StoreSettings


def test_comma_separated_etcd_endpoints_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_ETCD_ENDPOINTS", "127.0.0.1:2379, 127.0.0.2:2380")
    settings = StoreSettings()
    assert settings.etcd_endpoints == ["127.0.0.1:2379", "127.0.0.2:2380"]
    assert not settings.embedded


def test_no_endpoints_selects_the_embedded_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_ETCD_ENDPOINTS", raising=False)
    assert StoreSettings().embedded


@pytest.mark.parametrize("bad", ["localhost", "h:0", "h:99999", ":2379"])
def test_bad_endpoint_is_rejected_at_start(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("KVBRIDGE_ETCD_ENDPOINTS", bad)
    with pytest.raises(ValidationError, match="host:port"):
        StoreSettings()
