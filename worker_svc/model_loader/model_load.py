"""What a rank is asked to load and what it answers (LoadModel, Describe), decoded from the
contract by worker_svc/convert.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Self

from splitserve_contracts.engine_options_types import EngineOptions
from splitserve_contracts.output_types import PoolerConfig
from splitserve_runtime.engine_option_rules import engine_options, replace_options


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
    """What to load and where this rank sits (the LoadModelRequest, decoded): the engine's
    options, the same on every rank, and what is this rank's own."""

    options: EngineOptions = field(default_factory=EngineOptions)
    rank: int = 0
    """rank = pp_rank * tensor_parallel_size + tp_rank."""
    rendezvous_id: str = ""
    """This bring-up's rendezvous (LoadModelRequest.rendezvous_id)."""

    @classmethod
    def of(cls, model: str, rank: int = 0, rendezvous_id: str = "", **options: Any) -> Self:
        """A config from flat option names: `LoadModelConfig.of(path, block_size=4)`."""
        return cls(engine_options(model=model, **options), rank, rendezvous_id)

    def with_options(self, **fields: Any) -> Self:
        """This config with the options named (flat: `max_model_len=128`) changed."""
        return replace(self, options=replace_options(self.options, **fields))

    @property
    def model_path(self) -> str:
        return self.options.model.model


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
