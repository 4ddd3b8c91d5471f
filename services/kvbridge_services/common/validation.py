"""Request-field checks every service's handlers share. Identifiers are checked by their one rule in
:mod:`kvbridge.ids` (``ids.TENANT.check(field, value)``, called directly); what is here is the rest that
more than one service needs. Every failure is INVALID_ARGUMENT with a machine reason and the field named in
its metadata (kvbridge.errors); the service-specific checks (an entry's chain, a lease's TTL) stay in each
service's own validation module."""

from __future__ import annotations

from google.protobuf import duration_pb2

from kvbridge.errors import InvalidArgument, Reason, invalid_field

_MAX_DURATION_S = 315_576_000_000  # google.protobuf.Duration's range


def too_large(field: str, message: str, *, limit: int | None = None) -> InvalidArgument:
    """TOO_LARGE: more items (or a larger value) than the service accepts in one message."""
    metadata = {"field": field} if limit is None else {"field": field, "limit": str(limit)}
    return InvalidArgument(Reason.TOO_LARGE, f"{field}: {message}", metadata=metadata)


def must_be_empty(value: str | int, field: str, why: str) -> None:
    if value:
        raise invalid_field(field, f"must be empty {why}")


def required_id(value: int, field: str) -> int:
    """A numeric id that is never 0 (lease ids, node lease ids)."""
    if value == 0:
        raise invalid_field(field, "must be set (ids are never 0)")
    return value


def page_size(field: str, value: int, *, default: int, maximum: int) -> int:
    """A list request's page size: 0 is ``default``; above ``maximum`` is TOO_LARGE."""
    if value == 0:
        return default
    if value > maximum:
        raise too_large(field, f"{value} exceeds the limit of {maximum} per page", limit=maximum)
    return value


def duration_s(field: str, d: duration_pb2.Duration) -> float:
    """A google.protobuf.Duration field in seconds; one outside Duration's own range, or with nanos that do not
    fit its seconds, is INVALID_FIELD (not an overflow deeper down)."""
    bad_nanos = abs(d.nanos) >= 1_000_000_000 or (d.seconds > 0 > d.nanos) or (d.seconds < 0 < d.nanos)
    if bad_nanos or abs(d.seconds) > _MAX_DURATION_S:
        raise invalid_field(field, "is not a valid Duration")
    return d.seconds + d.nanos / 1e9
