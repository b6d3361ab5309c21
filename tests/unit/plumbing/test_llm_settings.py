"""`LLM(model, **kwargs)`'s settings (splitserve/inprocess.py EngineSettings): vLLM's engine
argument names fill the engine options record and its rules check them; a spawned engine core
gets them back as the flags that fill them (core_svc/option_flags.py)."""

from __future__ import annotations

import pytest

from core_svc.config import parse_config
from splitserve.inprocess import ENGINE_ARGS, EngineSettings
from splitserve_runtime.engine_option_rules import InvalidEngineOptions

SETTINGS = {
    "dtype": "bfloat16",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "block_size": 32,
    "enable_prefix_caching": False,
    "gpu_memory_utilization": 0.5,
    "scheduling_policy": "priority",
    "adaptive_prefill_chunk": 0,
    "enforce_eager": True,
    "disable_sliding_window": True,
    "quantization": "int8",
}


def test_engine_arguments_fill_the_record_and_the_rest_stays_local() -> None:
    settings = EngineSettings.of("/m", served_model_name="x", async_scheduling=None, **SETTINGS)
    options = settings.options
    assert (settings.model, options.model.dtype, options.cache.block_size) == ("/m", "bfloat16", 32)
    assert options.cache.enable_prefix_caching is False
    assert (options.scheduler.policy, options.scheduler.adaptive_prefill_chunk) == ("priority", 0)
    assert options.scheduler.async_scheduling is True  # None: on (one pipeline stage)
    assert settings.served_model_name == "x" and settings.core_config().served_model_name == "x"
    assert settings.core_config().options == options


def test_an_unknown_argument_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        EngineSettings.of("/m", max_num_seq=4)
    with pytest.raises(TypeError, match="'max_loras'"):
        EngineSettings.of("/m", max_loras=2)  # no adapter can be loaded through LLM
    assert "model" not in ENGINE_ARGS and "tensor_parallel_size" not in ENGINE_ARGS


def test_a_value_the_rules_refuse_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidEngineOptions, match=r"cache.gpu_memory_utilization must be in"):
        EngineSettings.of("/m", gpu_memory_utilization=1.5)
    with pytest.raises(InvalidEngineOptions, match="scheduler.policy is 'lifo'"):
        EngineSettings.of("/m", policy="lifo")
    with pytest.raises(InvalidEngineOptions, match="kv_transfer.kv_connector is 'C'"):
        EngineSettings.of("/m", kv_transfer_config={"kv_connector": "C", "kv_role": "kv_both"})


def test_a_spawned_core_parses_the_flags_back_into_the_same_options() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    settings = EngineSettings.of(
        "/m", async_scheduling=False, speculative_config=spec, served_model_name="x", **SETTINGS
    )
    flags = settings.core_flags(2, 1)
    assert "--model" not in flags and flags.count("--max-num-batched-tokens") == 1
    argv = ["--worker-addrs", "h:1,h:2", "--tp", "2", "--model", "/m", *flags]
    config = parse_config(argv, {})
    expected = settings.options
    assert config.options.model == expected.model and config.options.cache == expected.cache
    assert config.options.speculative == expected.speculative
    assert config.options.scheduler.max_num_batched_tokens == 2 * 2048  # per rank, x ranks
    assert config.options.scheduler.async_scheduling is False
    assert (config.options.scheduler.policy, config.served_model_name) == ("priority", "x")
