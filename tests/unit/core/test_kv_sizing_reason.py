"""The core's start-up log says why the KV cache has its size."""

from __future__ import annotations

from core_svc.config import CoreConfig
from core_svc.worker_pool import ModelFacts, kv_sizing_reason


def facts(num_kv_blocks: int) -> ModelFacts:
    return ModelFacts("LlamaForCausalLM", 32000, 100, "float32", "torch", num_kv_blocks, 1 << 20)


def test_reasons() -> None:
    config = CoreConfig.of(model="m", worker_addrs=["127.0.0.1:1"], max_num_seqs=4, block_size=16)
    # 4 requests x ceil(100 / 16) = 7 blocks, plus the null block: 29 blocks is all it can use.
    assert "max_num_seqs 4 x max_model_len 100" in kv_sizing_reason(config, facts(29))
    assert "the memory the workers may use" in kv_sizing_reason(config, facts(28))
    flagged = CoreConfig.of(model="m", worker_addrs=["127.0.0.1:1"], kv_cache_memory_bytes=1 << 20)
    assert kv_sizing_reason(flagged, facts(28)) == "--kv-cache-memory-bytes"
