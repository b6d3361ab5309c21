"""--kv-cache-dtype fp8 / fp8_e5m2 on a worker rank: the cache is allocated in one byte per
value, so the same memory holds twice the blocks of a bf16 cache (the count the core takes);
checkpoint k_scale / v_scale tensors reach each layer's attention; other values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.load_requests import load_request
from worker_svc.attention.kv_quant import KvScales
from worker_svc.convert import load_model_config_from_proto
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_cache_holds_twice_the_blocks_of_bf16(
    worker_checkpoints: CheckpointCache, kv_cache_dtype: str
) -> None:
    path = str(worker_checkpoints.get("llama"))
    budget = 1 << 20
    counts = {}
    for name in ("auto", kv_cache_dtype):
        worker = Worker("cpu")
        worker.load_model(LoadModelConfig.of(path, dtype="bfloat16", kv_cache_dtype=name))
        capacity = worker.get_kv_capacity(0.9, budget)
        counts[name] = capacity.num_blocks
        worker.initialize_kv_cache(capacity.num_blocks)
        assert worker.runner is not None and worker.runner.kv_cache is not None
        layer = worker.runner.kv_cache.layers[0]
        assert layer.dtype == (torch.bfloat16 if name == "auto" else FP8[name])
        assert worker.runner.kv_cache.nbytes <= budget
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 2 bytes (bf16) or 1 byte (fp8)
    assert counts["auto"] == budget // (2 * 2 * 16 * 2 * 16 * 2)
    assert counts[kv_cache_dtype] == 2 * counts["auto"]


def test_checkpoint_kv_scales_reach_each_layer(
    worker_checkpoints: CheckpointCache, tmp_path: Path
) -> None:
    """compressed-tensors' `self_attn.k_scale` (a 0-d tensor here), the older
    `self_attn.v_proj.output_scale` naming ([1]) and AutoFP8's one `kv_scale` for both; a
    cache in the model's dtype loads the same checkpoint (the scales unused, as vLLM)."""
    source = worker_checkpoints.get("llama")
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_proj.output_scale"] = torch.tensor([2.0])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.5])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    for name, expected in (("fp8", KvScales(0.25, 2.0)), ("auto", None)):
        worker = Worker("cpu")
        worker.load_model(LoadModelConfig.of(str(tmp_path), kv_cache_dtype=name))
        assert worker.runner is not None
        layers = worker.runner.model.layers  # type: ignore[attr-defined]
        if expected is not None:
            assert layers[0].self_attn.backend.kv_scales == expected
            assert layers[1].self_attn.backend.kv_scales == KvScales(0.5, 0.5)
            assert layers[0].self_attn.backend.is_fp8_kv_cache
        else:
            assert not layers[0].self_attn.backend.is_fp8_kv_cache


def test_other_kv_cache_dtypes_are_refused(worker_checkpoints: CheckpointCache) -> None:
    path = str(worker_checkpoints.get("llama"))
    request = load_request(model_path=path, block_size=16, kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="cache.kv_cache_dtype is 'fp8_inc'; choose one of auto"):
        load_model_config_from_proto(request)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported"):
        Worker("cpu").load_model(LoadModelConfig.of(path, kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="no fp8 KV cache"):
        Worker("cpu").load_model(
            LoadModelConfig.of(path, kv_cache_dtype="fp8", attention_backend="triton")
        )
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        KvScales(k_scale=0.0)
