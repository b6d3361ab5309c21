"""The one generic converter between a tree of frozen dataclass records and the protobuf messages
they mirror (field for field, same names), worked out from the message descriptor and the record
types, so a field added to the contract and its generated record needs no converter change.

A scalar field is copied by name; a field whose type is another record (a group) recurses into
that record's message; a group typed `X | None` (a proto `optional` message) is left unset when
None and reads as None when the message lacks it. Reading, a zero scalar takes the record field's
default (so an older peer's unset field reads as the contract says), except in an `optional`
scalar, whose zero is a value of its own: only an unset one takes the default. Each (record,
message) pair's plan is worked out once; a conversion then walks a short tuple (it runs per
LoadModel / EngineInfo, not per step). engine_options_convert.py binds it to EngineOptions.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
R = TypeVar("R")
Descriptor = Any
"""A message's descriptor (the stubs type `Message.DESCRIPTOR` as two classes)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    default: Any
    """A scalar's default: what an unset (or, without presence, a zero) field reads as."""
    group: type[Any] | None
    """A group field's record type; None for a scalar."""
    optional: bool
    """The field has presence: an `optional` scalar, or a group that may be None."""


def _group_of(hint: Any) -> tuple[type[Any] | None, bool]:
    """(the record type a field holds, whether it may be None); (None, False) for a scalar."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        group, _ = _group_of(args[0]) if len(args) == 1 else (None, False)
        return group, group is not None
    is_record = isinstance(hint, type) and dataclasses.is_dataclass(hint)
    return (hint, False) if is_record else (None, False)


def _field(f: dataclasses.Field[Any], hint: Any, descriptor: Descriptor) -> _Field:
    group, optional = _group_of(hint)
    wire = descriptor.fields_by_name[f.name]
    if (group is None) != (wire.message_type is None) or wire.is_repeated:
        raise TypeError(f"{descriptor.full_name}.{f.name}: the record's field does not mirror it")
    return _Field(f.name, f.default, group, optional or (group is None and wire.has_presence))


_PLANS: dict[tuple[type[Any], Descriptor], tuple[_Field, ...]] = {}


def _plan(record_type: type[Any], descriptor: Descriptor) -> tuple[_Field, ...]:
    """How `record_type` maps onto `descriptor`'s message, worked out on its first conversion;
    a TypeError names a field the record and the message do not share alike."""
    plan = _PLANS.get((record_type, descriptor))
    if plan is None:
        hints = typing.get_type_hints(record_type)
        fields = dataclasses.fields(record_type)
        if [f.name for f in fields] != [f.name for f in descriptor.fields]:
            raise TypeError(f"{record_type.__name__} does not mirror {descriptor.full_name}")
        plan = tuple(_field(f, hints[f.name], descriptor) for f in fields)
        _PLANS[(record_type, descriptor)] = plan
    return plan


def to_proto(record: Any, msg: M) -> M:
    """Fill `msg` from `record` (a dataclass mirroring its message) and return it."""
    for f in _plan(type(record), msg.DESCRIPTOR):
        value = getattr(record, f.name)
        if f.group is None:
            setattr(msg, f.name, value)
        elif value is not None:
            to_proto(value, getattr(msg, f.name))
    return msg


def from_proto(msg: Message, record_type: type[R]) -> R:
    """`msg` as a `record_type`: a zero scalar (an unset one, with presence) as its field's
    default, an unset optional group as None."""
    values: dict[str, Any] = {}
    for f in _plan(record_type, msg.DESCRIPTOR):
        if f.optional and not msg.HasField(f.name):
            values[f.name] = None if f.group is not None else f.default
        elif f.group is not None:
            values[f.name] = from_proto(getattr(msg, f.name), f.group)
        elif f.optional:
            values[f.name] = getattr(msg, f.name)
        else:
            values[f.name] = getattr(msg, f.name) or f.default
    return record_type(**values)
