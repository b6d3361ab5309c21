"""The engine options' generated records and converters (protos/python_options.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve_contracts import engine_info
from splitserve_contracts import engine_options_convert as convert
from splitserve_contracts.common.v1 import engine_options_pb2 as pb
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.engine_options_types import (
    CHOICES,
    FIELD_GROUP,
    GROUPS,
    HELP,
    CacheOptions,
    EngineOptions,
    LoRAOptions,
    ModelOptions,
    SchedulerOptions,
    SpeculativeOptions,
)


def test_an_empty_message_reads_as_the_contract_defaults() -> None:
    options = convert.from_proto(pb.EngineOptions())
    assert options == EngineOptions()
    assert options.model.dtype == "auto" and options.cache.block_size == 16
    assert options.parallel.tensor_parallel_size == 1 and options.lora.max_lora_rank == 16
    assert options.speculative is None


OPTIONS = EngineOptions(
    model=ModelOptions(model="/m", dtype="bfloat16", seed=7, runner="pooling"),
    cache=CacheOptions(block_size=32, kv_cache_dtype="fp8"),
    lora=LoRAOptions(max_loras=2, max_lora_rank=8, max_cpu_loras=4),
    speculative=SpeculativeOptions("ngram", 3, 2, 4),
)


def test_every_field_survives_the_round_trip() -> None:
    options = OPTIONS
    msg = convert.to_proto(options)
    assert msg.HasField("speculative") and msg.lora.max_cpu_loras == 4
    assert convert.from_proto(pb.EngineOptions.FromString(msg.SerializeToString())) == options


def test_an_optional_scalar_carries_its_zero_and_reads_unset_as_its_default() -> None:
    """enable_prefix_caching (unset: true) and adaptive_prefill_chunk (unset: 192) are
    `optional`: false and 0 travel as themselves; an older peer's unset field is the default."""
    defaults = convert.from_proto(pb.EngineOptions())
    assert defaults.cache.enable_prefix_caching is True
    assert defaults.scheduler.adaptive_prefill_chunk == 192
    assert (defaults.scheduler.policy, defaults.cache.gpu_memory_utilization) == ("fcfs", 0.9)
    off = EngineOptions(
        cache=CacheOptions(enable_prefix_caching=False, kv_cache_memory_bytes=1 << 33),
        scheduler=SchedulerOptions(adaptive_prefill_chunk=0, policy="priority"),
    )
    wire = pb.EngineOptions.FromString(convert.to_proto(off).SerializeToString())
    assert convert.from_proto(wire) == off


def _other_than_default(f: dataclasses.Field[Any]) -> object:
    """A value for scalar field `f` that is neither its default nor a zero."""
    default = f.default
    if isinstance(default, bool):
        return not default  # a bool that defaults to true is `optional`: its false travels
    if isinstance(default, int | float):
        return default + 3 if isinstance(default, int) else default + 0.5
    return f"x{default}"


def test_every_field_at_a_non_default_value_survives_the_round_trip() -> None:
    """Every field of every group, read from the records (a new field is covered unasked)."""
    groups = {
        name: record(**{f.name: _other_than_default(f) for f in dataclasses.fields(record)})
        for name, record in GROUPS.items()
    }
    options = EngineOptions(**groups)
    assert all(getattr(options, g) != record() for g, record in GROUPS.items())
    wire = pb.EngineOptions.FromString(convert.to_proto(options).SerializeToString())
    assert convert.from_proto(wire) == options


def test_an_unset_optional_group_stays_unset() -> None:
    msg = convert.to_proto(dataclasses.replace(OPTIONS, speculative=None))
    assert not msg.HasField("speculative")
    assert convert.from_proto(msg).speculative is None
    into = pb.EngineOptions()
    assert convert.to_proto(OPTIONS, into) is into and into.speculative.method == "ngram"


def test_the_records_mirror_their_messages_field_for_field() -> None:
    """The generic converter walks the records: each must name its message's fields."""
    for name, record in GROUPS.items():
        message = pb.EngineOptions.DESCRIPTOR.fields_by_name[name].message_type
        assert [f.name for f in dataclasses.fields(record)] == [f.name for f in message.fields]


def test_the_tables_cover_every_field_once() -> None:
    paths = {
        f"{group}.{f.name}" for group, record in GROUPS.items() for f in dataclasses.fields(record)
    }
    assert set(HELP) == paths and all(HELP.values())
    assert {f"{g}.{name}" for name, g in FIELD_GROUP.items()} == paths
    assert set(CHOICES) <= paths
    assert [f.name for f in dataclasses.fields(EngineOptions)] == list(GROUPS)


def test_engine_info_carries_the_options_and_their_deprecated_copies() -> None:
    """A new frontend reads `options`; an old one the flat copies, which name the same values;
    from an old core (no `options`) the copies rebuild the options they copied."""
    options = dataclasses.replace(OPTIONS, speculative=None)
    info = engine_info.fill_options(core_pb2.EngineInfo(served_model_name="m"), options)
    wire = core_pb2.EngineInfo.FromString(info.SerializeToString())
    assert engine_info.options_of(wire) == options
    assert (wire.model_path, wire.block_size, wire.cache_dtype) == ("/m", 32, "fp8")
    assert (wire.max_loras, wire.max_lora_rank) == (2, 8)
    wire.ClearField("options")
    old = engine_info.options_of(wire)
    assert (old.model.model, old.cache, old.parallel) == ("/m", options.cache, options.parallel)
    assert (old.scheduler.max_num_seqs, old.lora.max_lora_rank) == (256, 8)  # no copy: default
    assert old.lora.max_cpu_loras == 0 and old.model.seed == 0  # no copy: the default


def test_every_deprecated_field_of_engine_info_copies_an_option() -> None:
    deprecated = {
        f.name for f in core_pb2.EngineInfo.DESCRIPTOR.fields if f.GetOptions().deprecated
    }
    assert set(engine_info.DEPRECATED_COPIES) == deprecated
    for group, name in engine_info.DEPRECATED_COPIES.values():
        assert FIELD_GROUP[name] == group
