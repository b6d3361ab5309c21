"""The one generic converter between a tree of frozen dataclass records and the protobuf messages
they mirror (field for field, same names), read from the record types alone, so a field added to
the contract and its generated record needs no converter change.

A scalar field is copied by name; a field whose type is another record (a group) recurses into
that record's message; a group typed `X | None` (a proto `optional` message) is left unset when
None and reads as None when the message lacks it. Reading, a zero scalar takes the record field's
default (so an older peer's unset field reads as the contract says). Each record type's plan is
worked out once; a conversion then walks a short tuple (it runs per LoadModel / EngineInfo, not
per step). engine_options_convert.py binds it to EngineOptions.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    default: Any
    """A scalar's default: what a zero on the wire reads as."""
    group: type[Any] | None
    """A group field's record type; None for a scalar."""
    optional: bool
    """A group that may be None (unset on the wire)."""


def _group_of(hint: Any) -> tuple[type[Any] | None, bool]:
    """(the record type a field holds, whether it may be None); (None, False) for a scalar."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        group, _ = _group_of(args[0]) if len(args) == 1 else (None, False)
        return group, group is not None
    is_record = isinstance(hint, type) and dataclasses.is_dataclass(hint)
    return (hint, False) if is_record else (None, False)


_PLANS: dict[type[Any], tuple[_Field, ...]] = {}


def _plan(record_type: type[Any]) -> tuple[_Field, ...]:
    """`record_type`'s fields, worked out on its first conversion."""
    plan = _PLANS.get(record_type)
    if plan is None:
        hints = typing.get_type_hints(record_type)
        fields = dataclasses.fields(record_type)
        plan = tuple(_Field(f.name, f.default, *_group_of(hints[f.name])) for f in fields)
        _PLANS[record_type] = plan
    return plan


def to_proto(record: Any, msg: M) -> M:
    """Fill `msg` from `record` (a dataclass mirroring its message) and return it."""
    for f in _plan(type(record)):
        value = getattr(record, f.name)
        if f.group is None:
            setattr(msg, f.name, value)
        elif value is not None:
            to_proto(value, getattr(msg, f.name))
    return msg


def from_proto(msg: Message, record_type: type[R]) -> R:
    """`msg` as a `record_type`, a zero scalar as its field's default."""
    values: dict[str, Any] = {}
    for f in _plan(record_type):
        if f.group is None:
            values[f.name] = getattr(msg, f.name) or f.default
        elif f.optional and not msg.HasField(f.name):
            values[f.name] = None
        else:
            values[f.name] = from_proto(getattr(msg, f.name), f.group)
    return record_type(**values)
