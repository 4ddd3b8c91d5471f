"""Page tokens of the List* RPCs: opaque to clients, bound to the query they continue.

A token is the last key of its page behind 8 bytes of the query's SHA-256, so a token handed back with
another query (another tenant, model or engine filter) is refused instead of read as a position in it.
"""

from __future__ import annotations

import base64
import hashlib

from kvbridge.errors import InvalidArgument, Reason

MAX_TOKEN_CHARS = 2048
_TAG_BYTES = 8


def _tag(query: bytes) -> bytes:
    return hashlib.sha256(query).digest()[:_TAG_BYTES]


def encode_page_token(query: bytes, last_key: bytes) -> str:
    """The token that continues ``query`` after ``last_key``."""
    return base64.urlsafe_b64encode(_tag(query) + last_key).decode()


def decode_page_token(token: str, query: bytes) -> bytes:
    """The last key of the previous page of ``query``; INVALID_PAGE_TOKEN if ``token`` is malformed, too long,
    empty of a key, or was made for another query."""
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raw = b""
    if len(token) > MAX_TOKEN_CHARS or len(raw) <= _TAG_BYTES or raw[:_TAG_BYTES] != _tag(query):
        raise InvalidArgument(
            Reason.INVALID_PAGE_TOKEN, "malformed page token or not of this query", metadata={"field": "page_token"}
        )
    return raw[_TAG_BYTES:]
