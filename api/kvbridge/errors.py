"""Errors on the wire: gRPC status + google.rpc.ErrorInfo(domain="kvbridge.dev").

The list of reasons lives in one place, the proto enum
``kvbridge.types.v1.ErrorReason``; :class:`Reason` is derived from it. Servers
raise :class:`KvbridgeError` and translate it once, at the boundary, with
:meth:`KvbridgeError.to_status`; clients turn an ``RpcError`` back into the
typed exception with :func:`from_rpc_error` and branch on ``.reason``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvbridge.types.v1 import types_pb2

DOMAIN = "kvbridge.dev"
PROTO_PREFIX = "ERROR_REASON_"


class Reason(enum.StrEnum):
    """Machine reasons (ErrorInfo.reason): mirrors kvbridge.types.v1.ErrorReason.

    tests/unit/api/test_errors.py fails if this list and the proto enum differ.
    """

    INVALID_FIELD = "INVALID_FIELD"
    TOO_LARGE = "TOO_LARGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    TENANT_FORBIDDEN = "TENANT_FORBIDDEN"
    ENTRY_NOT_FOUND = "ENTRY_NOT_FOUND"
    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
    STALE_EPOCH = "STALE_EPOCH"
    IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    NOT_LEADER = "NOT_LEADER"
    LEASE_MISMATCH = "LEASE_MISMATCH"
    TTL_OUT_OF_RANGE = "TTL_OUT_OF_RANGE"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    NO_ENGINE_AVAILABLE = "NO_ENGINE_AVAILABLE"
    UPSTREAM_FAILED = "UPSTREAM_FAILED"
    OVERLOADED = "OVERLOADED"
    INVALID_PAGE_TOKEN = "INVALID_PAGE_TOKEN"
    ENGINE_RESTARTED = "ENGINE_RESTARTED"
    STREAM_IDLE = "STREAM_IDLE"
    STORE_NO_SPACE = "STORE_NO_SPACE"


# The exception class of each status code, filled by the subclasses below as they are defined.
_BY_CODE: dict[grpc.StatusCode, type[KvbridgeError]] = {}


class KvbridgeError(Exception):
    """An error with a gRPC code and a machine reason.

    A subclass names its status code as a class argument (``class NotFound(KvbridgeError, code=...)``), which
    also makes it the class :func:`from_rpc_error` raises for that code.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            if code in _BY_CODE:  # from_rpc_error raises one class per code
                raise TypeError(f"{_BY_CODE[code].__name__} already stands for {code.name}")
            cls.code = code
            _BY_CODE[code] = cls

    def __init__(
        self,
        reason: Reason | str,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason.value if isinstance(reason, Reason) else str(reason)
        self.message = message
        if code is not None:
            self.code = code
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"

    def to_status(self) -> grpc.Status:
        """The status to abort an RPC with (``context.abort_with_status``)."""
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)
        detail = any_pb2.Any()
        detail.Pack(info)
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=[detail])
        result: grpc.Status = rpc_status.to_status(status)
        return result


class InvalidArgument(KvbridgeError, code=grpc.StatusCode.INVALID_ARGUMENT): ...


class NotFound(KvbridgeError, code=grpc.StatusCode.NOT_FOUND): ...


class FailedPrecondition(KvbridgeError, code=grpc.StatusCode.FAILED_PRECONDITION): ...


class AlreadyExists(KvbridgeError, code=grpc.StatusCode.ALREADY_EXISTS): ...


class PermissionDenied(KvbridgeError, code=grpc.StatusCode.PERMISSION_DENIED): ...


class Unauthenticated(KvbridgeError, code=grpc.StatusCode.UNAUTHENTICATED): ...


class ResourceExhausted(KvbridgeError, code=grpc.StatusCode.RESOURCE_EXHAUSTED): ...


class Unavailable(KvbridgeError, code=grpc.StatusCode.UNAVAILABLE): ...


class DeadlineExceeded(KvbridgeError, code=grpc.StatusCode.DEADLINE_EXCEEDED): ...


class Aborted(KvbridgeError, code=grpc.StatusCode.ABORTED): ...


class Internal(KvbridgeError, code=grpc.StatusCode.INTERNAL): ...


_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def reason_number(reason: str) -> int:
    """The ``kvbridge.types.v1.ErrorReason`` value of a machine reason, for a reason carried in a message field
    rather than a status (0, ERROR_REASON_UNSPECIFIED, for one the enum does not know)."""
    try:
        return int(types_pb2.ErrorReason.Value(PROTO_PREFIX + reason))
    except ValueError:
        return 0


def reason_name(number: int) -> str:
    """The machine reason of an ``ErrorReason`` value ("" for UNSPECIFIED or an unknown value)."""
    try:
        name = types_pb2.ErrorReason.Name(number)  # type: ignore[arg-type]
    except ValueError:
        return ""
    return "" if number == 0 else name.removeprefix(PROTO_PREFIX)


def invalid_field(field: str, message: str) -> InvalidArgument:
    """The usual validation error: INVALID_ARGUMENT / INVALID_FIELD, naming the field."""
    return InvalidArgument(Reason.INVALID_FIELD, f"{field}: {message}", metadata={"field": field})


def from_rpc_error(error: grpc.RpcError) -> KvbridgeError:
    """The typed exception for an RpcError (reason "" when the server sent no ErrorInfo)."""
    code: grpc.StatusCode = getattr(error, "code", lambda: grpc.StatusCode.UNKNOWN)()
    message: str = getattr(error, "details", lambda: "")() or ""
    reason = ""
    metadata: dict[str, str] = {}
    status = _status_of(error)
    if status is not None:
        code = _CODE_BY_NUMBER.get(status.code, code)
        message = status.message or message
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN:
                    reason, metadata = info.reason, dict(info.metadata)
                    break
    cls = _BY_CODE.get(code, KvbridgeError)
    err = cls(reason, message, code=code, metadata=metadata)
    err.__cause__ = error
    return err


def _status_of(error: Any) -> status_pb2.Status | None:
    try:
        if isinstance(error, grpc.Call):
            return rpc_status.from_call(error)
        # grpc.aio errors carry trailing metadata the same way.
        trailing = error.trailing_metadata()
        for key, value in trailing or ():
            if key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                return status
    except (AttributeError, ValueError, TypeError):
        return None
    return None


__all__ = [
    "DOMAIN",
    "Reason",
    "KvbridgeError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "AlreadyExists",
    "PermissionDenied",
    "Unauthenticated",
    "ResourceExhausted",
    "Unavailable",
    "DeadlineExceeded",
    "Aborted",
    "Internal",
    "invalid_field",
    "from_rpc_error",
]
