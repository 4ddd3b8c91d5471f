"""The per-method cache of wrapped gRPC handlers: one wrap per method while grpc passes the same handler."""

from __future__ import annotations

from typing import Any

from kvbridge_services.common.handler_cache import WrappedHandlers


def test_wraps_each_method_once_and_again_when_its_handler_changes() -> None:
    calls: list[tuple[str, Any]] = []

    def wrap(method: str, handler: Any) -> Any:
        calls.append((method, handler))
        return ("wrapped", handler)

    cache = WrappedHandlers(wrap)
    first, other, replaced = object(), object(), object()
    assert cache.get("/s/A", first) == ("wrapped", first)
    assert cache.get("/s/A", first) is cache.get("/s/A", first)
    assert cache.get("/s/B", other) == ("wrapped", other)
    assert cache.get("/s/A", replaced) == ("wrapped", replaced)  # a new handler object is never served stale
    assert cache.get("/s/A", replaced) == ("wrapped", replaced)
    assert calls == [("/s/A", first), ("/s/B", other), ("/s/A", replaced)]
