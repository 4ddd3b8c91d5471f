"""Hypothesis strategies for protobuf requests: any message, fields filled with hostile values (test helper)."""

from __future__ import annotations

from typing import Any, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Plausible values mixed in so validation gets past its first check now and then.
PLAUSIBLE_STRINGS = [
    "acme",
    "globex",
    "unknown-tenant",
    "sim-model",
    "d0",
    "p0",
    "c1",
    "conv-1",
    "",
    " ",
    "a/b",
    "../../etc",
    "%00",
    "\u202e",
    "é" * 129,
]


def hostile_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(PLAUSIBLE_STRINGS),
        st.text(max_size=40),
        st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=3000),
        st.sampled_from(["x" * 257, "x" * 129, "\x00", "\n\r\t", "😀" * 70]),
    )


def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, -1, lo, hi, hi - 1, 2**31 - 1, 2**32 - 1, 16, 1 << 20) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return hostile_text()
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\x00" * 16, b"\xff" * 17]))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([-1.0, 0.0, 1e30, -1e30])
        )
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None, field.full_name  # an enum field always names its enum
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _int(-(2**31), 2**31 - 1))
    lo, hi = _INT_RANGES[t]
    return _int(lo, hi)


def _fill(cls: type[Message], descriptor: Descriptor, values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        if _repeated(field):
            target = getattr(msg, name)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def messages(cls: type[Message], depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of ``cls`` with a random subset of fields set to hostile values."""
    # The stubs type DESCRIPTOR as the Python or the upb (C) descriptor; at run time it is the upb one, which
    # has the same interface, and message_factory's stubs accept only the Python type.
    descriptor = cast(Descriptor, cls.DESCRIPTOR)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            sub_cls = _message_class(field)
            if sub_cls is None:
                continue
            value: st.SearchStrategy[Any] = messages(sub_cls, depth - 1)
        else:
            value = _scalar(field)
        if _repeated(field):
            value = st.lists(value, max_size=4 if field.type == FieldDescriptor.TYPE_MESSAGE else 8)
        fields[field.name] = value
    return st.fixed_dictionaries({}, optional=fields).map(lambda vals: _fill(cls, descriptor, vals))


def _repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated  # protobuf >= 7 (api/pyproject.toml): FieldDescriptor.label is gone


def _message_class(field: FieldDescriptor) -> type[Message] | None:
    from google.protobuf import message_factory

    if field.message_type is None:
        return None
    try:
        return message_factory.GetMessageClass(field.message_type)
    except Exception:  # noqa: BLE001 - skip types without a generated class
        return None


def invalid_utf8_string_field(field_number: int) -> bytes:
    """Wire bytes of a length-delimited field holding invalid UTF-8 (protobuf refuses to build it for us)."""
    payload = b"\xff\xfe\xc3\x28"
    return bytes([(field_number << 3) | 2, len(payload)]) + payload


def raw_wire() -> st.SearchStrategy[bytes]:
    """Malformed wire bytes: random binary, truncated fields, invalid UTF-8 in field 1..4."""
    return st.one_of(
        st.binary(min_size=1, max_size=64),
        st.sampled_from([b"\x0a\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x08", b"\x12\x80\x80"]),
        st.integers(1, 4).map(invalid_utf8_string_field),
    )
