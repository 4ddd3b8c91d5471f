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

    class FakeAioError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return status.trailing_metadata

    back = errors.from_rpc_error(FakeAioError())
    assert isinstance(back, errors.InvalidArgument)
    assert back.reason == "INVALID_FIELD"
    assert back.metadata == {"field": "entry.block_size"}
    assert "must be 1..1024" in back.message


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE])
def test_error_without_error_info_keeps_code(code: grpc.StatusCode) -> None:
    class Plain(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return code

        def details(self) -> str:
            return "plain"

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return ()

    back = errors.from_rpc_error(Plain())
    assert back.code is code and back.reason == "" and back.message == "plain"
