"""The generic record <-> message converter (splitserve_contracts/record_convert.py) on a contract
it has never seen: a group, an `optional` group and bool / float / int / string scalars, the way
a field added to engine_options.proto reaches it, and an `optional` scalar whose zero is a value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from splitserve_contracts import record_convert

F = descriptor_pb2.FieldDescriptorProto


def _messages() -> tuple[Any, Any]:
    file = descriptor_pb2.FileDescriptorProto(
        name="unseen.proto", package="unseen", syntax="proto3"
    )
    group = file.message_type.add(name="Knobs")
    for number, (name, kind) in enumerate(
        [
            ("on", F.TYPE_BOOL),
            ("ratio", F.TYPE_FLOAT),
            ("count", F.TYPE_INT64),
            ("label", F.TYPE_STRING),
        ],
        start=1,
    ):
        group.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    root = file.message_type.add(name="Root")
    root.field.add(name="knobs", number=1, type=F.TYPE_MESSAGE, type_name=".unseen.Knobs")
    root.field.add(
        name="extra",
        number=2,
        type=F.TYPE_MESSAGE,
        type_name=".unseen.Knobs",
        proto3_optional=True,
        oneof_index=0,
    )
    root.field.add(name="depth", number=3, type=F.TYPE_INT32)
    root.field.add(name="cached", number=4, type=F.TYPE_BOOL, proto3_optional=True, oneof_index=1)
    root.oneof_decl.add(name="_extra")
    root.oneof_decl.add(name="_cached")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    classes = message_factory.GetMessageClassesForFiles(["unseen.proto"], pool)
    return classes["unseen.Root"], classes["unseen.Knobs"]


Root, Knobs = _messages()


@dataclass(frozen=True, slots=True)
class KnobsRecord:
    on: bool = False
    ratio: float = 0.25
    count: int = 4
    label: str = "auto"


@dataclass(frozen=True, slots=True)
class RootRecord:
    knobs: KnobsRecord = field(default_factory=KnobsRecord)
    extra: KnobsRecord | None = None
    depth: int = 0
    cached: bool = True
    """An `optional` scalar: false is a value, unset means true."""


def test_unseen_fields_round_trip() -> None:
    record = RootRecord(KnobsRecord(True, 1.5, 9, "x"), KnobsRecord(label="y"), 2, cached=False)
    msg = record_convert.to_proto(record, Root())
    assert msg.HasField("extra") and msg.knobs.ratio == 1.5 and msg.extra.label == "y"
    assert record_convert.from_proto(Root.FromString(msg.SerializeToString()), RootRecord) == record


def test_zeros_read_as_the_record_defaults_and_an_unset_optional_group_as_none() -> None:
    assert record_convert.from_proto(Root(), RootRecord) == RootRecord()
    msg = record_convert.to_proto(RootRecord(), Root())
    assert not msg.HasField("extra")
    assert record_convert.from_proto(msg, RootRecord).extra is None
    assert record_convert.from_proto(Root(extra=Knobs()), RootRecord).extra == KnobsRecord()


def test_an_optional_scalar_reads_its_zero_and_defaults_only_when_unset() -> None:
    assert record_convert.from_proto(Root(cached=False), RootRecord).cached is False
    assert record_convert.from_proto(Root(), RootRecord).cached is True
    assert record_convert.to_proto(RootRecord(cached=False), Root()).HasField("cached")


@dataclass(frozen=True, slots=True)
class Mismatched:
    knobs: KnobsRecord = field(default_factory=KnobsRecord)


def test_a_record_that_does_not_mirror_its_message_is_refused() -> None:
    with pytest.raises(TypeError, match="does not mirror unseen.Root"):
        record_convert.from_proto(Root(), Mismatched)
