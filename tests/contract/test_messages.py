"""Contract tests on the generated messages: round-trips and pinned wire bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from google.protobuf.message import Message

from tests.contract.message_samples import all_message_classes, fill, representative_messages

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SPLITSERVE_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("cls", all_message_classes(), ids=lambda c: c.DESCRIPTOR.full_name)
def test_every_message_round_trips(cls: type[Message]) -> None:
    original = fill(cls())
    wire = original.SerializeToString(deterministic=True)
    decoded = cls.FromString(wire)
    assert decoded == original
    assert decoded.SerializeToString(deterministic=True) == wire
    if cls.DESCRIPTOR.fields:
        assert wire, "a filled message must not encode to nothing"


def test_every_message_is_covered() -> None:
    names = {c.DESCRIPTOR.full_name for c in all_message_classes()}
    for required in (
        "splitserve.common.v1.SamplingParams",
        "splitserve.core.v1.EngineCoreRequest",
        "splitserve.core.v1.EngineCoreOutputs",
        "splitserve.worker.v1.SchedulerOutput",
        "splitserve.worker.v1.ModelRunnerOutput",
        "splitserve.frontend.v1.GenerateRequest",
    ):
        assert required in names


@pytest.mark.parametrize("name", sorted(representative_messages()))
def test_golden_wire_bytes(name: str) -> None:
    msg = representative_messages()[name]
    wire = msg.SerializeToString(deterministic=True)
    path = GOLDEN_DIR / f"{name}.hex"
    if UPDATE:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(wire.hex() + "\n")
    assert path.exists(), f"missing {path}; run with SPLITSERVE_UPDATE_GOLDEN=1 once"
    assert wire.hex() == path.read_text().strip(), (
        f"the wire encoding of {name} changed: a contract change must be deliberate "
        "(update the golden file with SPLITSERVE_UPDATE_GOLDEN=1 only if it is)"
    )
    assert type(msg).FromString(bytes.fromhex(path.read_text().strip())) == msg


def test_optional_presence_survives_the_wire() -> None:
    from splitserve_contracts.common.v1 import types_pb2

    zero_temp = types_pb2.SamplingParams(temperature=0.0)
    decoded = types_pb2.SamplingParams.FromString(zero_temp.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0
    assert not types_pb2.SamplingParams().HasField("temperature")


def test_enums_start_at_unspecified() -> None:
    for cls in all_message_classes():
        for enum in cls.DESCRIPTOR.file.enum_types_by_name.values():
            assert enum.values[0].number == 0
            assert enum.values[0].name.endswith("_UNSPECIFIED")
