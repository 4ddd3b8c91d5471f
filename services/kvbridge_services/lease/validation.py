"""Request field checks of the lease API that only the lease manager has (each failure names its field).
Identifiers: kvbridge.ids; the checks services share: kvbridge_services.common.validation."""

from __future__ import annotations

from google.protobuf import duration_pb2

from kvbridge.errors import InvalidArgument, Reason
from kvbridge_services.common.validation import duration_s as checked_duration_s


def ttl(d: duration_pb2.Duration, *, present: bool, default_s: float, min_s: float, max_s: float) -> float:
    if not present:
        return default_s
    seconds = checked_duration_s("ttl", d)
    if not min_s <= seconds <= max_s:
        raise InvalidArgument(
            Reason.TTL_OUT_OF_RANGE,
            f"ttl: {seconds:g}s is outside the allowed range [{min_s:g}s, {max_s:g}s]",
            metadata={"field": "ttl", "min_ttl_s": f"{min_s:g}", "max_ttl_s": f"{max_s:g}"},
        )
    return seconds
