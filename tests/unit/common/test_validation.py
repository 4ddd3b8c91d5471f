"""The request-field checks the services share (kvbridge_services.common.validation)."""

from __future__ import annotations

import pytest
from google.protobuf import duration_pb2

from kvbridge.errors import InvalidArgument, Reason
from kvbridge_services.common import validation as cv


def test_a_duration_outside_protobufs_range_is_invalid_not_an_overflow() -> None:
    # timedelta() of this overflowed a C int: a hostile WatchEntries answered INTERNAL (found by hypothesis).
    for d in (
        duration_pb2.Duration(seconds=2**62),
        duration_pb2.Duration(seconds=-(2**62)),
        duration_pb2.Duration(seconds=1, nanos=-1),
        duration_pb2.Duration(nanos=1_000_000_000),
    ):
        with pytest.raises(InvalidArgument) as err:
            cv.duration_s("progress_interval", d)
        assert err.value.metadata["field"] == "progress_interval"
    assert cv.duration_s("ttl", duration_pb2.Duration(seconds=2, nanos=500_000_000)) == 2.5
    assert cv.duration_s("ttl", duration_pb2.Duration()) == 0.0


def test_page_size_defaults_and_refuses_more_than_the_limit_as_too_large() -> None:
    assert cv.page_size("page_size", 0, default=100, maximum=1000) == 100
    assert cv.page_size("page_size", 1000, default=100, maximum=1000) == 1000
    with pytest.raises(InvalidArgument) as err:
        cv.page_size("page_size", 1001, default=100, maximum=1000)
    assert err.value.reason == Reason.TOO_LARGE.value and err.value.metadata == {"field": "page_size", "limit": "1000"}


def test_ids_that_are_never_zero_and_fields_that_must_stay_empty() -> None:
    assert cv.required_id(7, "lease_id") == 7
    with pytest.raises(InvalidArgument):
        cv.required_id(0, "lease_id")
    cv.must_be_empty("", "model", "for a NODE lease")
    with pytest.raises(InvalidArgument) as err:
        cv.must_be_empty("m", "model", "for a NODE lease")
    assert "must be empty for a NODE lease" in str(err.value)
