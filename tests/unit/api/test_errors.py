import grpc
import pytest

from kvbridge import errors
from kvbridge.types.v1 import types_pb2


def test_reason_enum_mirrors_the_proto_enum() -> None:
    proto = {
        name.removeprefix(errors.PROTO_PREFIX)
        for name in types_pb2.ErrorReason.keys()  # noqa: SIM118 - proto enum wrapper
        if name != "ERROR_REASON_UNSPECIFIED"
    }
    assert {r.value for r in errors.Reason} == proto


def test_status_round_trips_code_reason_and_metadata() -> None:
    err = errors.invalid_field("entry.block_size", "must be 1..1024")
    status = err.to_status()
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT

    # The error a grpc.aio client raises, carrying the status details in its trailing metadata.
    aio_error = grpc.aio.AioRpcError(
        status.code, trailing_metadata=grpc.aio.Metadata(*status.trailing_metadata), details=status.details
    )
    back = errors.from_rpc_error(aio_error)
    assert isinstance(back, errors.InvalidArgument)
    assert back.reason == "INVALID_FIELD"
    assert back.metadata == {"field": "entry.block_size"}
    assert "must be 1..1024" in back.message


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE])
def test_error_without_error_info_keeps_code(code: grpc.StatusCode) -> None:
    back = errors.from_rpc_error(grpc.aio.AioRpcError(code, details="plain"))
    assert back.code is code and back.reason == "" and back.message == "plain"


def test_a_second_class_for_a_status_code_is_refused() -> None:
    # from_rpc_error raises one class per code: a later subclass may not silently take NOT_FOUND over.
    with pytest.raises(TypeError, match="NotFound already stands for NOT_FOUND"):

        class Missing(errors.KvbridgeError, code=grpc.StatusCode.NOT_FOUND): ...
