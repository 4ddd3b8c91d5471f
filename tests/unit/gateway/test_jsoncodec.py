"""gateway/jsoncodec.py: strict client-body parsing and the fast engine-body encoder."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.errors import InvalidArgument
from kvbridge_services.gateway.jsoncodec import dumps, loads_engine, loads_strict
from kvbridge_services.gateway.requests import parse_json_body

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too: the fallback encoder
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),  # lone surrogates too: the fallback encoder
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=25,
)


@given(JSON_VALUES)
def test_dumps_writes_the_document_the_standard_library_reads_back_unchanged(value: object) -> None:
    assert json.loads(dumps(value)) == json.loads(json.dumps(value))


def test_a_big_prompt_of_token_ids_round_trips() -> None:
    body = {"model": "m", "prompt": list(range(100, 24_676)), "max_tokens": 1}
    assert loads_strict(dumps(body)) == body


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": 1e400}'])
def test_non_finite_numbers_are_refused_at_parse_time(raw: bytes) -> None:
    with pytest.raises(ValueError):
        loads_strict(raw)


def test_integers_beyond_64_bits_stay_exact() -> None:
    big = 2**70 + 1
    assert loads_strict(json.dumps({"seed": big}))["seed"] == big
    assert json.loads(dumps({"seed": big}))["seed"] == big


def test_a_client_body_with_nan_is_invalid_argument_naming_the_body() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_json_body(b'{"model": "m", "temperature": NaN}')
    assert err.value.metadata == {"field": "body"}


@given(JSON_VALUES.filter(lambda v: "NaN" not in json.dumps(v)))
def test_an_engine_answer_reads_as_the_standard_library_reads_it(value: object) -> None:
    raw = json.dumps(value).encode()
    got, want = loads_engine(raw), json.loads(raw)
    if not _has_huge_int(want):  # vLLM never writes one (its ids and counts are below 2^63)
        assert got == want


def test_an_engine_answer_orjson_refuses_is_read_by_the_standard_library() -> None:
    assert loads_engine(b'{"logprob": NaN, "text": "\\ud800"}')["text"] == "\ud800"


def _has_huge_int(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value < 2**64
    if isinstance(value, list):
        return any(_has_huge_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_huge_int(v) for v in value.values())
    return False
