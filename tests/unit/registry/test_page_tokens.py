"""Page tokens: a token continues the query it was made for, and nothing else."""

from __future__ import annotations

import pytest

from kvbridge.errors import InvalidArgument, Reason
from kvbridge_services.registry.page_tokens import MAX_TOKEN_CHARS, decode_page_token, encode_page_token

QUERY = b"/kvbridge/entries/acme/m/\x00d0"


def refused(token: str, query: bytes = QUERY) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        decode_page_token(token, query)
    return err.value


@pytest.mark.parametrize("last_key", [b"k", b"/kvbridge/entries/acme/m/conv 1", b"\x00\xfb\xff\xfe" * 5])
def test_a_token_gives_back_the_last_key_of_its_query(last_key: bytes) -> None:
    token = encode_page_token(QUERY, last_key)
    assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=")  # URL-safe
    assert decode_page_token(token, QUERY) == last_key


@pytest.mark.parametrize("other", [b"/kvbridge/entries/acme/m/\x00d1", b"/kvbridge/entries/other/m/\x00d0", b"engines"])
def test_a_token_of_another_query_is_refused(other: bytes) -> None:
    err = refused(encode_page_token(QUERY, b"k"), other)
    assert err.reason == Reason.INVALID_PAGE_TOKEN
    assert err.metadata == {"field": "page_token"}


@pytest.mark.parametrize(
    "token",
    [
        "",  # nothing
        "abc",  # bad padding
        "pâge",  # not ASCII: refused as a token, not a UnicodeEncodeError
        encode_page_token(QUERY, b""),  # the query's tag without a key
        encode_page_token(QUERY, b"k")[:-4],  # cut short
    ],
)
def test_malformed_tokens_are_invalid_page_token(token: str) -> None:
    assert refused(token).reason == Reason.INVALID_PAGE_TOKEN


def test_tokens_past_the_length_bound_are_refused() -> None:
    longest = encode_page_token(QUERY, b"k" * (MAX_TOKEN_CHARS * 3 // 4 - 8))
    assert len(longest) == MAX_TOKEN_CHARS
    assert decode_page_token(longest, QUERY) == b"k" * (MAX_TOKEN_CHARS * 3 // 4 - 8)
    too_long = encode_page_token(QUERY, b"k" * (MAX_TOKEN_CHARS * 3 // 4 - 7))
    assert refused(too_long).reason == Reason.INVALID_PAGE_TOKEN
