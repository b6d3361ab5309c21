"""The engine options' rules (splitserve_runtime/engine_option_rules.py): the core's flags and a
rank's LoadModel are refused with the same words, naming the field."""

from __future__ import annotations

import dataclasses
import re

import pytest

from core_svc.config import parse_config as parse_core
from core_svc.core_flags import CORE_FLAGS
from splitserve.launcher import parse_args as parse_serve
from splitserve_contracts import engine_options_convert
from splitserve_contracts.engine_options_types import GROUPS, EngineOptions, LoRAOptions
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_runtime.engine_option_rules import (
    InvalidEngineOptions,
    engine_options,
    lora_enabled,
    lora_options,
    replace_options,
    validate,
)
from tests.fixtures.load_requests import load_request
from worker_svc.convert import load_model_config_from_proto

WORKERS = ["--worker-addrs", "h:1,h:2"]


def test_the_defaults_pass() -> None:
    assert validate(EngineOptions()) == EngineOptions()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"dtype": "float8"}, "model.dtype is 'float8'; choose one of auto"),
        ({"runner": "draft"}, "model.runner is 'draft'; choose one of auto, generate, pooling"),
        (
            {"logprobs_mode": "logits"},
            "model.logprobs_mode is 'logits'; choose one of raw_logprobs",
        ),
        ({"kv_cache_dtype": "int8"}, "cache.kv_cache_dtype is 'int8'"),
        ({"quantization": "bnb"}, "model.quantization is 'bnb'"),
        ({"max_loras": 300}, "lora.max_loras is 300, more than 256"),
        ({"max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 600}, "lora.max_lora_rank must be"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "lora.max_cpu_loras (2) must be >= lora.max_loras"),
        (
            {"async_scheduling": True, "pipeline_parallel_size": 2},
            "scheduler.async_scheduling needs parallel.pipeline_parallel_size 1",
        ),
        (
            {"gpu_memory_utilization": 1.5},
            "cache.gpu_memory_utilization must be in (0, 1], got 1.5",
        ),
        ({"policy": "lifo"}, "scheduler.policy is 'lifo'; choose one of fcfs, priority"),
    ],
)
def test_a_rank_refuses_what_the_rules_refuse_naming_the_field(
    fields: dict[str, object], says: str
) -> None:
    with pytest.raises(InvalidEngineOptions, match=re.escape(says)) as refused:
        load_model_config_from_proto(load_request("/m", **fields))
    assert refused.value.field == str(refused.value).split()[0]


def test_the_core_refuses_its_flags_with_the_ranks_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*WORKERS, "--tp", "2", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"]
    with pytest.raises(SystemExit):
        parse_core(argv, {})
    said = capsys.readouterr().err
    with pytest.raises(InvalidEngineOptions) as refused:
        load_model_config_from_proto(load_request("/m", max_loras=4, max_cpu_loras=2))
    assert f"--max-cpu-loras: {refused.value}" in said


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--gpu-memory-utilization", "0"],
            "--gpu-memory-utilization: cache.gpu_memory_utilization must be in (0, 1], got 0.0",
        ),
        (
            ["--scheduling-policy", "lifo"],
            "--scheduling-policy: invalid choice: 'lifo' (choose from 'fcfs', 'priority')",
        ),
    ],
)
def test_the_core_refuses_a_moved_option_naming_flag_and_field(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_core([*WORKERS, "--tp", "2", *argv], {})
    assert says in capsys.readouterr().err


def test_the_scheduler_rows_name_the_field() -> None:
    for name, says in [
        ("max_num_seqs", "scheduler.max_num_seqs must be >= 1, got 0"),
        ("max_num_batched_tokens", "scheduler.max_num_batched_tokens must be >= 1, got 0"),
        ("adaptive_prefill_chunk", "scheduler.adaptive_prefill_chunk must be >= 0, got -1"),
        ("max_num_queued_reqs", "scheduler.max_num_queued_reqs must be >= 0, got -1"),
    ]:
        value = -1 if ">= 0" in says else 0
        with pytest.raises(InvalidEngineOptions, match=re.escape(says)):
            validate(engine_options({name: value}))


def test_lora_options_follow_enable_lora() -> None:
    on = lora_options(True, LoRAOptions(max_loras=3))
    assert (lora_enabled(on), on.max_cpu_loras) == (True, 3)
    off = lora_options(False, LoRAOptions(max_loras=3, max_cpu_loras=5))
    assert (lora_enabled(off), off.max_loras, off.max_cpu_loras) == (False, 0, 0)


def test_a_grammar_timeout_out_of_range_is_refused_by_its_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_core([*WORKERS[:1], "h:1", "--structured-outputs-config", '{"compile_timeout": 0}'])
    assert (
        "--structured-outputs-config: structured_outputs.compile_timeout must be a number of "
        "seconds in (0, 600], got 0.0" in capsys.readouterr().err
    )


def test_logprobs_mode_reaches_the_ranks_options() -> None:
    config = parse_core([*WORKERS[:1], "h:1", "--logprobs-mode", "processed_logprobs"], {})
    assert config.options.model.logprobs_mode == "processed_logprobs"
    assert parse_core([*WORKERS[:1], "h:1"], {}).options.model.logprobs_mode == "raw_logprobs"
    request = pb.LoadModelRequest(options=engine_options_convert.to_proto(config.options))
    assert load_model_config_from_proto(request).options.model.logprobs_mode == "processed_logprobs"
    serve = parse_serve(["tiny", "--logprobs-mode", "raw_logits"], {})
    assert serve.service_flags["core"] == ["--logprobs-mode", "raw_logits"]


def test_disable_sliding_window_reaches_the_ranks_options() -> None:
    config = parse_core([*WORKERS[:1], "h:1", "--disable-sliding-window"], {})
    assert config.options.model.disable_sliding_window is True
    assert parse_core([*WORKERS[:1], "h:1"], {}).options.model.disable_sliding_window is False
    request = pb.LoadModelRequest(options=engine_options_convert.to_proto(config.options))
    assert load_model_config_from_proto(request).options.model.disable_sliding_window is True
    serve = parse_serve(["tiny", "--disable-sliding-window"], {})
    assert serve.service_flags["core"] == ["--disable-sliding-window"]


def test_every_option_is_filled_by_a_core_flag() -> None:
    filled = {row.fills for row in CORE_FLAGS if row.fills}
    for group, record in GROUPS.items():
        if group in filled:  # the whole group (--speculative-config)
            continue
        for f in dataclasses.fields(record):
            assert f"{group}.{f.name}" in filled, f"no flag fills {group}.{f.name}"


def test_flat_names_build_and_replace_options() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_min": 1}
    options = engine_options(model="/m", block_size=8, speculative=spec | {"prompt_lookup_max": 2})
    assert options.model.model == "/m" and options.cache.block_size == 8
    assert options.speculative is not None and options.speculative.prompt_lookup_max == 2
    with pytest.raises(ValueError, match="num_speculative_tokens must be in 1..16"):
        validate(options)  # the speculative group follows --speculative-config's rules
    assert replace_options(options, max_loras=2).lora.max_loras == 2
    with pytest.raises(TypeError, match="'block' is not an engine option"):
        engine_options(block=8)
