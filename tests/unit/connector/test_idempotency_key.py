"""The connector's registration idempotency key (issue 30, item 8): a long or unusual vLLM request id is hashed,
never cut or rewritten, so two requests never share a key (the registry would answer the second with the
first's record)."""

from __future__ import annotations

from kvbridge import ids
from kvbridge_connector.control_plane import _idempotency_key


def test_a_request_id_that_fits_is_kept_as_is() -> None:
    assert _idempotency_key("d0", "chatcmpl-abc-1234abcd") == "d0:chatcmpl-abc-1234abcd"


def test_long_request_ids_sharing_a_prefix_get_different_keys() -> None:
    # vLLM: "chatcmpl-" + the client's request_id + "-" + 8 random characters; the unique part is at the end.
    client = "x" * 200
    a = _idempotency_key("d0", f"chatcmpl-{client}-1234abcd")
    b = _idempotency_key("d0", f"chatcmpl-{client}-5678efgh")
    assert a != b
    for key in (a, b):
        assert ids.REQUEST_ID.check("request_id", key) == key  # a valid registry request id
    assert _idempotency_key("d1", f"chatcmpl-{client}-1234abcd") != a  # scoped by engine


def test_characters_outside_the_alphabet_are_not_rewritten_into_a_collision() -> None:
    a, b = _idempotency_key("d0", "req/1"), _idempotency_key("d0", "req_1")
    assert a != b and b == "d0:req_1"
    assert ids.REQUEST_ID.check("request_id", a) == a
