"""Building one rank's model shard for the Worker (worker.py): which model class a checkpoint
is served with, the checks of its shape against the parallel layout, the attention backend and
build context, the linear methods (FP8, quantized, LoRA) and the pooler's config."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from splitserve_contracts.engine_options_types import ModelOptions
from splitserve_contracts.output_types import PoolerConfig
from splitserve_runtime.model_source import ModelSource
from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.kv_quant import KvScales
from worker_svc.attention.selector import backend_class
from worker_svc.distributed import ParallelState
from worker_svc.kernels.cpu_kernels import CpuKernels, using_cpu_kernels
from worker_svc.layers.fp8 import can_keep_fp8
from worker_svc.layers.linear import LinearMethods, kv_heads_per_rank
from worker_svc.layers.lora import LoraBatch, LoraLinearMethods, LoraShape
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.model_loader.pooling_config import (
    classifier_config,
    is_pooling_runner,
    read_pooler_config,
)
from worker_svc.model_loader.weights import Checkpoint, fp8_linear_methods, num_fp8_layers
from worker_svc.models.decoder import BuildContext
from worker_svc.models.interfaces import CausalLM
from worker_svc.models.model_config import ModelConfig, architecture_of
from worker_svc.models.registry import (
    has_lm_head,
    is_sequence_classifier,
    model_class,
    pooling_model_class,
)

logger = logging.getLogger(__name__)

Weights = Iterator[tuple[str, TensorSource]]


def model_class_for(config: LoadModelConfig, checkpoint: Checkpoint) -> tuple[type[CausalLM], bool]:
    """The class the checkpoint is served with, and whether it pools (--runner, --convert)."""
    architecture = architecture_of(checkpoint.hf_config)
    model = config.options.model
    is_pooling = is_pooling_runner(model.runner, model.convert, has_lm_head(architecture))
    num_labels = int(getattr(checkpoint.hf_config, "num_labels", 1))
    cls = pooling_model_class(architecture, num_labels) if is_pooling else model_class(architecture)
    return cls, is_pooling


def build_context(
    backend_name: str,
    model: ModelConfig,
    dtypes: tuple[torch.dtype, torch.dtype],
    max_model_len: int,
    parallel: ParallelState,
    device: torch.device,
) -> tuple[AttentionBackend, BuildContext]:
    """The attention backend for this rank's heads and what the model is built with, in
    `dtypes` (compute, KV cache); a backend that runs the CPU kernels loads them (where
    they build) for itself and for the model's ops."""
    dtype, kv_dtype = dtypes
    cls = backend_class(backend_name)
    kernels = CpuKernels.load() if cls.uses_cpu_kernels else None
    tp = parallel.tp_size
    with using_cpu_kernels(kernels):
        backend = cls(
            model.num_heads // tp,
            kv_heads_per_rank(model.num_kv_heads, tp),
            model.head_dim,
            dtype=dtype,
            device=device,
            kv_cache_dtype=kv_dtype,
            value_dim=model.kv_value_dim,
        )
    build = BuildContext(
        model,
        parallel,
        backend,
        dtype,
        device,
        max_positions=max(max_model_len, model.max_position_embeddings),
        context_len=max_model_len,
        cpu_kernels=kernels,
    )
    return backend, build


def build_model(
    cls: type[CausalLM],
    build: BuildContext,
    checkpoint: Checkpoint,
    lora: tuple[LoraBatch, LoraShape] | None,
) -> tuple[CausalLM, Callable[[Weights], Weights]]:
    """The shard, with FP8 linear methods where the device keeps an FP8 checkpoint's
    weights FP8, or quantized ones where the checkpoint (GGUF, compressed-tensors, AWQ) or
    --quantization asks for them (which layers: planned on a copy built on the meta
    device, which allocates nothing), every linear method wrapped with LoRA slots when
    LoRA is on; and the reader of the checkpoint's tensors for it."""
    methods: LinearMethods = build.linear_methods
    wrap: Callable[[Weights], Weights] = _as_read
    fp8 = checkpoint.fp8
    is_fp8 = fp8 is not None and can_keep_fp8(build.device, build.dtype)
    if fp8 is not None and is_fp8:
        methods = fp8_linear_methods(build.create(cls, device=torch.device("meta")), fp8)
    elif checkpoint.planner is not None:
        plan = checkpoint.planner(build.create(cls, device=torch.device("meta")))
        logger.info("%s", plan.summary)
        methods, wrap = plan.methods, plan.wrap
    if lora is not None:
        methods = LoraLinearMethods(methods, *lora)
    model = build.create(cls, linear_methods=methods)
    if is_fp8:
        logger.info("%d linear layers keep their weights in FP8", num_fp8_layers(model))
    return model, wrap


def pooler_config(
    source: ModelSource, checkpoint: Checkpoint, hidden_size: int, encoder_only: bool
) -> PoolerConfig:
    """How a pooling model pools: a sequence classifier through its score head, any other
    as its sentence-transformers files (or config.json) say."""
    hf_config = checkpoint.hf_config
    config = read_pooler_config(None if source.is_gguf else source.path, hf_config, hidden_size)
    if is_sequence_classifier(architecture_of(hf_config)):
        config = classifier_config(int(getattr(hf_config, "num_labels", 1)))
    config.is_encoder_only = encoder_only
    return config


def _as_read(weights: Weights) -> Weights:
    return weights


def lora_parts(
    config: LoadModelConfig, device: torch.device, kernels: CpuKernels | None
) -> tuple[LoraBatch, LoraShape] | None:
    """What every LoRA layer of the model shares (None: LoRA off); with the CPU kernels, one
    kernel call adds a layer's adapters."""
    shape = LoraShape.of(config.options.lora)
    return None if shape is None else (LoraBatch(device, kernels), shape)


def log_kv_cache(model: CausalLM, backend: AttentionBackend) -> None:
    """Which scales an fp8 KV cache stores with (vLLM warns likewise when it falls back to
    1.0: values beyond the format's range are then saturated)."""
    if not backend.is_fp8_kv_cache:
        return
    views = [getattr(m, "backend", None) for m in model.modules()]
    layers = [v for v in views if isinstance(v, AttentionBackend)]
    scaled = sum(v.kv_scales != KvScales() for v in layers)
    logger.info(
        "KV cache in %s: %d of %d attention layers have the checkpoint's k/v scales, the "
        "others 1.0",
        str(backend.kv_cache_dtype).removeprefix("torch."),
        scaled,
        len(layers),
    )


def backend_for_model(name: str, requested: str, model: ModelConfig) -> str:
    """The backend the model's attention needs: a latent cache (MLA) takes torch_mla; the cpu
    backend has no sliding windows, soft caps or sinks, and only the torch backend has sinks,
    so "auto" takes the torch backend for models that need what the chosen one lacks; asking
    for such a backend by name is refused."""
    if model.kv_value_dim is not None or name == "torch_mla":
        return _latent_backend(name, requested, model)
    layers = [model.layer_attention(i) for i in range(model.num_layers)]
    has_soft_caps = any(options.logits_soft_cap is not None for options in layers)
    has_sinks = any(options.has_sinks for options in layers)
    lacks = []
    if name == "cpu" and (model.sliding_window is not None or has_soft_caps):
        lacks.append("sliding windows or soft caps")
    if has_sinks and not backend_class(name).supports_sinks:
        lacks.append("attention sinks")
    if not lacks:
        return name
    if requested in ("", "auto"):
        return "torch"
    raise ValueError(
        f"attention backend {name!r} has no {' and no '.join(lacks)}, which this model uses; "
        "use --attention-backend torch (or auto)"
    )


def _latent_backend(name: str, requested: str, model: ModelConfig) -> str:
    """torch_mla for a latent-cache model (MLA); refused by name for any other model, and
    another backend named for an MLA model."""
    if model.kv_value_dim is None:
        raise ValueError(
            f"attention backend 'torch_mla' is for multi-head latent attention models "
            f"(DeepSeek-V2/V3); {model.architecture} has none"
        )
    if name == "torch_mla" or requested in ("", "auto"):
        return "torch_mla"
    raise ValueError(
        f"{model.architecture} caches latent keys and values (multi-head latent attention), "
        f"which attention backend {name!r} does not read; use --attention-backend auto"
    )


def check_parallel_shape(config: LoadModelConfig, model: ModelConfig) -> None:
    tp, pp = (
        config.options.parallel.tensor_parallel_size,
        config.options.parallel.pipeline_parallel_size,
    )
    heads, kv_heads = model.num_heads, model.num_kv_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the {heads} attention heads")
    if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the {kv_heads} KV heads, or be a multiple "
            "of them (each KV head is then replicated on tp / num_kv_heads ranks)"
        )
    if model.num_layers < pp:
        raise ValueError(f"{model.num_layers} layers cannot fill {pp} pipeline stages")


def served_model(model: ModelConfig, options: ModelOptions) -> tuple[ModelConfig, int]:
    """The model as the engine's model options serve it, and its max_model_len: the options'
    (0: the model's limit), refused past that limit. The one place where a model option
    shapes the model config the rank builds with.

    disable_sliding_window (vLLM's): every layer attends fully and the limit is capped to the
    window (a Gemma 3 local layer keeps its local rope)."""
    limit, requested, why = model.max_context_len, options.max_model_len, ""
    if options.disable_sliding_window and model.sliding_window is not None:
        limit, why = min(limit, model.sliding_window), " (its sliding window, which is disabled)"
        model = replace(model, sliding_window=None)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit}{why}")
    return model, requested or limit
