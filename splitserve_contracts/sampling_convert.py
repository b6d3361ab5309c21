"""Sampling messages <-> their plain views (sampling_types), driven by the message descriptors.

Field by field, by name: an unset `optional` field (or a zero scalar) takes the caller's default
for it if one is given (the model's generation config), else the view's default, which the
generated view took from the contract; repeated fields become tuples, maps dicts. The
same loop copies a SamplingParams view into a SamplerParams message (the sampler's fields are a
subset, with the same names). Nothing here names a field, so a new contract field needs no change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")


def _field_plan(descriptor: Any, names: tuple[str, ...]) -> list[tuple[str, str, bool]]:
    """(name, kind, has_presence) per name: kind is "map", "repeated" or "scalar"."""
    plan = []
    for name in names:
        fd: FieldDescriptor = descriptor.fields_by_name[name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            kind = "map"
        elif fd.is_repeated:
            kind = "repeated"
        else:
            kind = "scalar"
        plan.append((name, kind, fd.has_presence))
    return plan


_PLANS: dict[tuple[str, type | None], list[tuple[str, str, bool]]] = {}


def _plan(descriptor: Any, view: type | None) -> list[tuple[str, str, bool]]:
    """The plan over `view`'s fields, or over all of the message's fields when view is None."""
    key = (descriptor.full_name, view)
    plan = _PLANS.get(key)
    if plan is None:
        if view is None:
            names = tuple(f.name for f in descriptor.fields)
        else:
            names = tuple(f.name for f in dataclasses.fields(view))
        plan = _PLANS[key] = _field_plan(descriptor, names)
    return plan


def from_proto(msg: Message, view: type[T], defaults: Mapping[str, Any] | None = None) -> T:
    """The plain view of `msg`: every field of `view`; unset scalars at `defaults[name]` when
    given, else at the view's default."""
    values: dict[str, Any] = {}
    for name, kind, has_presence in _plan(msg.DESCRIPTOR, view):
        value = getattr(msg, name)
        if kind == "map":
            values[name] = dict(value)
        elif kind == "repeated":
            values[name] = tuple(value)
        elif msg.HasField(name) if has_presence else value:
            values[name] = value
        elif defaults and name in defaults:
            values[name] = defaults[name]
    return view(**values)


def to_proto(view: object, msg: Message) -> Message:
    """Fill `msg` from `view` (any object with attributes named like msg's fields); None leaves
    an optional field unset. Returns msg."""
    for name, kind, _ in _plan(msg.DESCRIPTOR, None):
        value = getattr(view, name)
        if kind == "map":
            getattr(msg, name).update(value)
        elif kind == "repeated":
            getattr(msg, name).extend(value)
        elif value is not None:
            setattr(msg, name, value)
    return msg
