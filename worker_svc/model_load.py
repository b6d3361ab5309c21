"""What a rank is asked to load and what it answers (LoadModel, Describe), decoded from the
contract by worker_svc/convert.py."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contracts.output_types import PoolerConfig
from splitserve_contracts.spec_decode import SpeculativeConfig

RUNNERS = ("", "auto", "generate", "pooling")
CONVERTS = ("", "auto", "none", "embed")


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    """The rank's process and device (the DescribeResponse)."""

    device_type: str
    device_name: str
    total_memory_bytes: int
    free_memory_bytes: int
    hostname: str
    pid: int
    torch_version: str
    attention_backends: list[str]


@dataclass(frozen=True, slots=True)
class LoadModelConfig:
    """What to load and where this rank sits (the LoadModelRequest, decoded)."""

    model_path: str
    dtype: str = "auto"
    rank: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_init_method: str = ""
    seed: int = 0
    max_model_len: int = 0
    attention_backend: str = "auto"
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    rendezvous_id: str = ""
    block_size: int = 16
    revision: str = ""
    enforce_eager: bool = False
    """Never compile the model into graphs (vLLM's --enforce-eager)."""
    enable_expert_parallel: bool = False
    async_scheduling: bool = False
    """The core schedules ahead (vLLM's --async-scheduling): the rank appends what it samples
    to its requests itself."""
    runner: str = "auto"
    """vLLM's --runner: "generate", "pooling" or "auto" (pooling for a checkpoint without an
    LM head)."""
    convert: str = "auto"
    """vLLM's --convert: "embed" serves a generative architecture as an embedder."""
    quantization: str = ""
    """vLLM's --quantization ("": the checkpoint's own), checked against the checkpoint."""
    dequantize_gguf: bool = False
    """Serve a GGUF file's quantized weights dequantized to float (--dequantize-gguf)."""
    kv_cache_dtype: str = "auto"
    """vLLM's --kv-cache-dtype: auto (the compute dtype), fp8 / fp8_e4m3 or fp8_e5m2."""
    max_loras: int = 0
    """LoRA adapter slots (vLLM's --max-loras); 0: LoRA off."""
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    """Adapters kept in host memory (at least max_loras)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding: the rank proposes and verifies drafts (worker_svc/spec_decode.py)."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Facts of the loaded shard (the LoadModelResponse)."""

    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    weight_bytes: int
    load_seconds: float
    attention_backend: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int = 0
    """The window every layer attends within (0: some layer attends fully)."""
    max_tokens_per_mm_item: int = 0
    """Placeholder tokens of one image; 0 for a text-only model."""
    pooler_config: PoolerConfig | None = None
    """How the rank pools, when it serves a pooling model; None for a generative one."""
