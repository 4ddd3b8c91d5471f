"""ListEngines over the index's engine records: filters, order by id, page tokens."""

from __future__ import annotations

import pytest

from kvbridge.errors import InvalidArgument, Reason
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.registry.engines import list_engines
from kvbridge_services.registry.page_tokens import encode_page_token

DECODE, PREFILL = types_pb2.ENGINE_ROLE_DECODE, types_pb2.ENGINE_ROLE_PREFILL


def engine(engine_id: str, model: str = "m", role: types_pb2.EngineRole.ValueType = DECODE) -> types_pb2.Engine:
    return types_pb2.Engine(engine_id=engine_id, model=model, role=role)


ENGINES = [engine("d2"), engine("p0", role=PREFILL), engine("d0"), engine("x0", model="other"), engine("d1")]


def ids(response: registry_pb2.ListEnginesResponse) -> list[str]:
    return [e.engine_id for e in response.engines]


def test_engines_are_listed_by_id_and_filtered_by_model_and_role() -> None:
    assert ids(list_engines(ENGINES, registry_pb2.ListEnginesRequest())) == ["d0", "d1", "d2", "p0", "x0"]
    assert ids(list_engines(ENGINES, registry_pb2.ListEnginesRequest(model="m"))) == ["d0", "d1", "d2", "p0"]
    assert ids(list_engines(ENGINES, registry_pb2.ListEnginesRequest(model="m", role=DECODE))) == ["d0", "d1", "d2"]
    assert ids(list_engines(ENGINES, registry_pb2.ListEnginesRequest(role=PREFILL))) == ["p0"]


def test_pages_go_on_from_the_last_id_and_the_last_page_has_no_token() -> None:
    pages: list[list[str]] = []
    token = ""
    while True:
        page = list_engines(ENGINES, registry_pb2.ListEnginesRequest(page_size=2, page_token=token))
        pages.append(ids(page))
        token = page.next_page_token
        if not token:
            break
    assert pages == [["d0", "d1"], ["d2", "p0"], ["x0"]]


def test_a_page_exactly_filling_the_rest_has_no_token() -> None:
    page = list_engines(ENGINES, registry_pb2.ListEnginesRequest(model="m", role=DECODE, page_size=3))
    assert ids(page) == ["d0", "d1", "d2"] and page.next_page_token == ""


def test_an_engine_registered_before_the_position_is_not_in_later_pages() -> None:
    first = list_engines(ENGINES, registry_pb2.ListEnginesRequest(page_size=2))
    later = [*ENGINES, engine("a0"), engine("e0")]
    second = list_engines(later, registry_pb2.ListEnginesRequest(page_size=2, page_token=first.next_page_token))
    assert ids(second) == ["d2", "e0"]


def test_a_token_of_another_list_is_refused() -> None:
    token = encode_page_token(b"/kvbridge/entries/acme/\x00", b"d1")
    with pytest.raises(InvalidArgument) as err:
        list_engines(ENGINES, registry_pb2.ListEnginesRequest(page_token=token))
    assert err.value.reason == Reason.INVALID_PAGE_TOKEN


def test_a_bad_model_filter_is_an_invalid_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        list_engines(ENGINES, registry_pb2.ListEnginesRequest(model="has space"))
    assert err.value.metadata["field"] == "model"


def test_a_token_is_bound_to_its_filters() -> None:
    first = list_engines(ENGINES, registry_pb2.ListEnginesRequest(model="m", page_size=2))
    assert ids(first) == ["d0", "d1"] and first.next_page_token
    for other in (registry_pb2.ListEnginesRequest(model="other"), registry_pb2.ListEnginesRequest(role=DECODE)):
        other.page_token = first.next_page_token
        with pytest.raises(InvalidArgument) as err:
            list_engines(ENGINES, other)
        assert err.value.reason == Reason.INVALID_PAGE_TOKEN
    same = registry_pb2.ListEnginesRequest(model="m", page_size=2, page_token=first.next_page_token)
    assert ids(list_engines(ENGINES, same)) == ["d2", "p0"]
