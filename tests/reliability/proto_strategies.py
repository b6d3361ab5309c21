"""Hypothesis strategies for protobuf messages, driven by their descriptors: every field of every
type, with the values that break servers (wire-range extremes, NaN and infinities, empty and
long strings, unknown enum values), so a new contract field is fuzzed the day it is added."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

Strategy = st.SearchStrategy[Any]
F = FieldDescriptor
MAX_DEPTH = 3


def _integers(lo: int, hi: int) -> Strategy:
    edges = sorted({lo, lo + 1, -1 if lo < 0 else 0, 0, 1, 2, 5, 64, 2048, 2049, hi - 1, hi})
    return st.sampled_from([e for e in edges if lo <= e <= hi]) | st.integers(lo, hi)


FLOAT_EDGES = [0.0, -0.0, 1.0, 0.5, -1.0, 2.0, 1e-30, 1e-5, 100.0, 1e30, 3e38]
SCALARS: dict[int, Strategy] = {
    F.TYPE_INT32: _integers(-(2**31), 2**31 - 1),
    F.TYPE_SINT32: _integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: _integers(-(2**63), 2**63 - 1),
    F.TYPE_SINT64: _integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: _integers(0, 2**32 - 1),
    F.TYPE_UINT64: _integers(0, 2**64 - 1),
    F.TYPE_FLOAT: st.sampled_from([*FLOAT_EDGES, float("nan"), float("inf"), float("-inf")])
    | st.floats(width=32),
    F.TYPE_DOUBLE: st.floats(),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.text(max_size=24) | st.sampled_from(["", "\x00", "x" * 300, "\ufffd"]),
    F.TYPE_BYTES: st.binary(max_size=24),
}


def _enum(field: FieldDescriptor) -> Strategy:
    numbers = [v.number for v in field.enum_type.values]
    return st.sampled_from(numbers) | st.integers(-5, 1000)


def field_values(
    field: FieldDescriptor, overrides: Mapping[str, Strategy], depth: int = 0
) -> Strategy:
    """Values for `field` (a list for repeated fields, a dict for maps)."""
    if field.full_name in overrides:
        return overrides[field.full_name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return st.dictionaries(
            field_values(key, overrides, depth), field_values(value, overrides, depth), max_size=6
        )
    if field.type == F.TYPE_MESSAGE:
        single = messages(field.message_type, overrides, depth + 1)
    elif field.type == F.TYPE_ENUM:
        single = _enum(field)
    else:
        single = SCALARS[field.type]
    if field.is_repeated:
        return st.lists(single, max_size=8)
    return single


def messages(
    descriptor: Descriptor, overrides: Mapping[str, Strategy] | None = None, depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type: each field set or left unset, one field of each real
    oneof; a field named in `overrides` (by its full name) is always set, from the
    override's values."""
    overrides = overrides or {}
    cls = GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    oneofs = [o for o in descriptor.oneofs if not o.name.startswith("_")]
    in_oneof = {f.name for o in oneofs for f in o.fields}
    plain = [f for f in descriptor.fields if f.name not in in_oneof]
    required = {
        f.name: field_values(f, overrides, depth) for f in plain if f.full_name in overrides
    }
    optional = {
        f.name: field_values(f, overrides, depth) for f in plain if f.full_name not in overrides
    }
    choices = [_one_of(o, overrides, depth) for o in oneofs]
    return st.tuples(
        st.fixed_dictionaries(required, optional=optional),
        st.tuples(*choices),
    ).map(lambda parts: _build(cls, parts[0], parts[1]))


def _one_of(oneof: Any, overrides: Mapping[str, Strategy], depth: int) -> Strategy:
    """(name, value) of one field of `oneof` (always one: a request without its input is a
    case of its own, not what fuzzing should spend most examples on)."""
    return st.sampled_from(list(oneof.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), field_values(f, overrides, depth))
    )


def _build(cls: type[Message], values: dict[str, Any], chosen: tuple[Any, ...]) -> Message:
    message = cls()
    for name, value in [*values.items(), *(c for c in chosen if c is not None)]:
        _set(message, name, value)
    return message


def _set(message: Message, name: str, value: Any) -> None:
    target = getattr(message, name)
    if isinstance(value, Message):
        target.CopyFrom(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif isinstance(value, list):
        target.extend(value)
    else:
        setattr(message, name, value)


def payloads(
    descriptor: Descriptor, overrides: Mapping[str, Strategy] | None = None
) -> st.SearchStrategy[bytes]:
    """Request bytes for a method taking `descriptor`'s message: random bytes, valid messages,
    and valid messages with a few bytes cut out or spliced in."""
    valid = messages(descriptor, overrides).map(lambda m: m.SerializeToString())
    spliced = st.tuples(valid, st.integers(0, 4096), st.integers(0, 8), st.binary(max_size=8))
    return st.one_of(st.binary(max_size=96), valid, spliced.map(_splice))


def _splice(parts: tuple[bytes, int, int, bytes]) -> bytes:
    data, at, num_cut, inserted = parts
    at %= len(data) + 1
    return data[:at] + inserted + data[at + num_cut :]
