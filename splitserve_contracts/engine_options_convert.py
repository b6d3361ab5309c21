"""EngineOptions (engine_options_types.py, generated) to and from its protobuf message, through the
one generic converter, record_convert.py: it walks the records' fields, so a field or group added
to engine_options.proto needs no change here. `from_proto` reads a zero scalar as the field's
contract default and an unset `optional` group (speculative) as None.
"""

from __future__ import annotations

from splitserve_contracts import record_convert
from splitserve_contracts.common.v1 import engine_options_pb2 as pb
from splitserve_contracts.engine_options_types import EngineOptions


def to_proto(record: EngineOptions, msg: pb.EngineOptions | None = None) -> pb.EngineOptions:
    """`record` in `msg` (a new message when None)."""
    return record_convert.to_proto(record, pb.EngineOptions() if msg is None else msg)


def from_proto(msg: pb.EngineOptions) -> EngineOptions:
    return record_convert.from_proto(msg, EngineOptions)
