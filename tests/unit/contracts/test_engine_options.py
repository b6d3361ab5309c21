"""The engine options' generated records and converters (protos/python_options.py)."""

from __future__ import annotations

import dataclasses

from splitserve_contracts import engine_options_convert as convert
from splitserve_contracts.common.v1 import engine_options_pb2 as pb
from splitserve_contracts.engine_options_types import (
    CHOICES,
    FIELD_GROUP,
    GROUPS,
    HELP,
    CacheOptions,
    EngineOptions,
    LoRAOptions,
    ModelOptions,
    SpeculativeOptions,
)


def test_an_empty_message_reads_as_the_contract_defaults() -> None:
    options = convert.from_proto(pb.EngineOptions())
    assert options == EngineOptions()
    assert options.model.dtype == "auto" and options.cache.block_size == 16
    assert options.parallel.tensor_parallel_size == 1 and options.lora.max_lora_rank == 16
    assert options.speculative is None


def test_every_field_survives_the_round_trip() -> None:
    options = EngineOptions(
        model=ModelOptions(model="/m", dtype="bfloat16", seed=7, runner="pooling"),
        cache=CacheOptions(block_size=32, kv_cache_dtype="fp8"),
        lora=LoRAOptions(max_loras=2, max_lora_rank=8, max_cpu_loras=4),
        speculative=SpeculativeOptions("ngram", 3, 2, 4),
    )
    msg = convert.to_proto(options)
    assert msg.HasField("speculative") and msg.lora.max_cpu_loras == 4
    assert convert.from_proto(pb.EngineOptions.FromString(msg.SerializeToString())) == options


def test_the_tables_cover_every_field_once() -> None:
    paths = {
        f"{group}.{f.name}" for group, record in GROUPS.items() for f in dataclasses.fields(record)
    }
    assert set(HELP) == paths and all(HELP.values())
    assert {f"{g}.{name}" for name, g in FIELD_GROUP.items()} == paths
    assert set(CHOICES) <= paths
    assert [f.name for f in dataclasses.fields(EngineOptions)] == list(GROUPS)
