"""Request field checks of the lease API (each failure names its field)."""

from __future__ import annotations

from google.protobuf import duration_pb2

from kvbridge import ids
from kvbridge.errors import InvalidArgument, Reason, invalid_field

from .codec import duration_s

_MAX_DURATION_S = 315_576_000_000  # google.protobuf.Duration range


# Identifier fields: the rules of kvbridge.ids, the same as the registry's and the gateway's.
def engine_id(value: str, field: str = "engine_id") -> str:
    return ids.ENGINE_ID.check(field, value)


def tenant(value: str, field: str = "tenant") -> str:
    return ids.TENANT.check(field, value)


def optional_tenant(value: str, field: str = "tenant") -> str:
    return ids.TENANT.check_optional(field, value)


def model(value: str, field: str = "model") -> str:
    return ids.MODEL.check(field, value)


def conversation_key(value: str, field: str = "conversation_key") -> str:
    return ids.CONVERSATION_KEY.check(field, value)


def optional_request_id(value: str, field: str = "request_id") -> str:
    return ids.REQUEST_ID.check_optional(field, value)


def must_be_empty(value: str | int, field: str, why: str) -> None:
    if value:
        raise invalid_field(field, f"must be empty {why}")


def ttl(d: duration_pb2.Duration, *, present: bool, default_s: float, min_s: float, max_s: float) -> float:
    if not present:
        return default_s
    bad_nanos = abs(d.nanos) >= 1_000_000_000 or (d.seconds > 0 > d.nanos) or (d.seconds < 0 < d.nanos)
    if bad_nanos or abs(d.seconds) > _MAX_DURATION_S:
        raise invalid_field("ttl", "is not a valid Duration")
    seconds = duration_s(d)
    if not min_s <= seconds <= max_s:
        raise InvalidArgument(
            Reason.TTL_OUT_OF_RANGE,
            f"ttl: {seconds:g}s is outside the allowed range [{min_s:g}s, {max_s:g}s]",
            metadata={"field": "ttl", "min_ttl_s": f"{min_s:g}", "max_ttl_s": f"{max_s:g}"},
        )
    return seconds


def lease_id(value: int, field: str = "lease_id") -> int:
    if value == 0:
        raise invalid_field(field, "must be set (lease ids are never 0)")
    return value


def too_large(field: str, count: int, limit: int) -> InvalidArgument:
    return InvalidArgument(
        Reason.TOO_LARGE,
        f"{field}: {count} items exceed the limit of {limit} per message",
        metadata={"field": field, "limit": str(limit)},
    )
