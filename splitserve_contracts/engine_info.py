"""core.v1.EngineInfo's options, and the deprecated copies of them it still carries.

An engine core fills `options` (the engine's whole EngineOptions) and, for frontends older
than that field, the flat copies EngineInfo had before it; a frontend reads `options`, or,
from an engine core older than the field, rebuilds them from those copies. Both directions
follow one table, read from the contract (the fields marked deprecated), so a copy can
neither be forgotten on one side nor read from the wrong field on the other.
"""

from __future__ import annotations

from splitserve_contracts import engine_options_convert
from splitserve_contracts.common.v1 import engine_options_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.engine_options_types import FIELD_GROUP, EngineOptions

RENAMED = {"model_path": "model", "cache_dtype": "kv_cache_dtype"}
"""The deprecated copies not named as the option they copy; every other one is."""


def _deprecated_copies() -> dict[str, tuple[str, str]]:
    """EngineInfo's fields marked deprecated in the contract -> the (group, field) of the
    option each copies; a KeyError at import names a deprecated field that copies no option."""
    fields = core_pb2.EngineInfo.DESCRIPTOR.fields
    names = [f.name for f in fields if f.GetOptions().deprecated]
    return {n: (FIELD_GROUP[RENAMED.get(n, n)], RENAMED.get(n, n)) for n in names}


DEPRECATED_COPIES = _deprecated_copies()


def fill_options(info: core_pb2.EngineInfo, options: EngineOptions) -> core_pb2.EngineInfo:
    """`info` with `options` and their deprecated copies filled."""
    engine_options_convert.to_proto(options, info.options)
    info.options.SetInParent()
    for name, (group, field) in DEPRECATED_COPIES.items():
        setattr(info, name, getattr(getattr(options, group), field))
    return info


def options_of(info: core_pb2.EngineInfo) -> EngineOptions:
    """The engine's options: `info.options`, or, from an engine core older than that field, its
    deprecated copies (every other option at its contract default)."""
    if info.HasField("options"):
        return engine_options_convert.from_proto(info.options)
    old = engine_options_pb2.EngineOptions()
    for name, (group, field) in DEPRECATED_COPIES.items():
        setattr(getattr(old, group), field, getattr(info, name))
    return engine_options_convert.from_proto(old)
