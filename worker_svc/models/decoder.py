"""A decoder-only causal LM cut into pipeline stages: what every family shares.

`DecoderForCausalLM` owns the stage's layer range, the token embedding (first stage), the final
norm and LM head (last stage), the rotary embedding, weight loading and the forward over the
layers. A family gives its decoder layers (`make_layer`) and, where it differs, its
configuration (`read_config`), final norm (`make_norm`), embeddings (`embed_input_ids`),
logits (`compute_logits`) and checkpoint tensor names (`resolve_weight_name`).

Pipeline parallelism: a stage owns the contiguous layer range `layer_range`; the first stage
embeds tokens, the last normalises and owns the LM head. Between stages travel the hidden
states and the residual stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.distributed import ParallelState
from worker_svc.kernels.cpu_kernels import CpuKernels, using_cpu_kernels
from worker_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.linear import UNQUANTIZED, LinearArgs, LinearMethods, linear_layers
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rope_config import RopeConfig
from worker_svc.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from worker_svc.layers.state_cache import LayerCache, StateMetadata
from worker_svc.layers.tensor_source import TensorSource, row_range
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import PACKED_MODULES, WeightTarget, resolve_weight_name


@dataclass(frozen=True, slots=True)
class StepContext:
    """Per-step values shared by every layer: rotary cos/sin of the positions, attention indices."""

    cos: torch.Tensor
    sin: torch.Tensor
    attn_metadata: object
    positions: torch.Tensor | None = None  # the step's positions (the CPU kernels rotate by them)
    state: StateMetadata | None = None
    """The requests' state slots, for a model with state layers (layers/state_cache.py)."""


M = TypeVar("M")


class ResidualNorm(Protocol):
    """A norm with the residual add before it (RMSNorm, GemmaRMSNorm)."""

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What every part of one model shard is built with (vLLM's VllmConfig, for one shard)."""

    config: ModelConfig
    parallel: ParallelState
    backend: AttentionBackend
    """The attention backend; each layer takes its own view (`with_options`)."""
    dtype: torch.dtype
    device: torch.device
    max_positions: int
    """Rotary tables cover positions [0, max_positions)."""
    context_len: int | None = None
    """The served context length (max_model_len), which dynamic rope scaling is fixed for."""
    linear_methods: LinearMethods = UNQUANTIZED
    """Which method each linear layer holds its weight with (unquantized; FP8 on devices that
    keep an FP8 checkpoint's weights FP8)."""
    cpu_kernels: CpuKernels | None = None
    """The CPU kernels the ops run (None: their torch implementation); see layers/custom_op.py."""

    def create(self, cls: Callable[[BuildContext], M], **changes: Any) -> M:
        """`cls` built from this context (with `changes` to it); its ops choose their
        implementation now, for good."""
        build = dataclasses.replace(self, **changes) if changes else self
        with using_cpu_kernels(build.cpu_kernels):
            return cls(build)

    def linear_args(self, prefix: str) -> LinearArgs:
        """The keyword arguments of a linear layer at module path `prefix`."""
        return {
            "parallel": self.parallel,
            "dtype": self.dtype,
            "device": self.device,
            "methods": self.linear_methods,
            "prefix": prefix,
        }

    def rotary(self, rope: RopeConfig) -> RotaryEmbedding:
        """The rotary embedding of `rope` (M-RoPE where it has an mrope_section)."""
        cls = MRotaryEmbedding if rope.mrope_section else RotaryEmbedding
        return cls(
            self.config.rope_head_dim or self.config.head_dim,
            self.max_positions,
            rope,
            dtype=self.dtype,
            device=self.device,
            context_len=self.context_len,
        )


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Contiguous layers [start, end) of pipeline stage `pp_rank`; earlier stages take the extras."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def join_prefix(prefix: str, name: str) -> str:
    """The module path `name` inside `prefix` (vLLM's maybe_prefix)."""
    return f"{prefix}.{name}" if prefix else name


class DecoderForCausalLM(nn.Module):
    """One pipeline stage of a decoder-only causal LM, sharded over the TP group."""

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = PACKED_MODULES

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__()
        config, parallel = build.config, build.parallel
        self.config = config
        self.parallel = parallel
        self.layer_range = stage_layer_range(config.num_layers, parallel.pp_rank, parallel.pp_size)
        self.rotary = build.rotary(config.rope)
        dtype, device = build.dtype, build.device
        self.embed_tokens: VocabParallelEmbedding | None = None
        methods = build.linear_methods
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                parallel=parallel,
                dtype=dtype,
                device=device,
                method=methods.vocab_method(join_prefix(prefix, "embed_tokens")),
            )
        start, end = self.layer_range
        self.layers = nn.ModuleList(
            self.make_layer(
                build,
                i,
                build.backend.with_options(config.layer_attention(i)),
                join_prefix(prefix, f"layers.{i - start}"),
            )
            for i in range(start, end)
        )
        self.norm: ResidualNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if parallel.is_last_stage:
            self.norm = self.make_norm(build)
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                parallel=parallel,
                dtype=dtype,
                device=device,
                method=methods.vocab_method(join_prefix(prefix, "lm_head")),
            )
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.tie_to(self.embed_tokens)

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return ModelConfig.from_hf_config(hf)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        """Decoder layer `layer` at module path `prefix`, attending through `backend` (its own
        view, with the layer's options): called (hidden, residual, ctx, kv_cache) -> (hidden,
        residual)."""
        raise NotImplementedError

    def make_norm(self, build: BuildContext) -> ResidualNorm:
        """The last stage's final norm; it has `add_and_norm(hidden, residual)`."""
        config = build.config
        return RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=build.dtype, device=build.device
        )

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        cos, sin = self.rotary.cos_sin(positions)
        return StepContext(cos, sin, attn_metadata, positions)

    def layer_contexts(self, ctx: StepContext) -> Sequence[StepContext]:
        """The step context each of this stage's layers attends with (Gemma 3 gives its
        sliding-window layers their own rope)."""
        return [ctx] * len(self.layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        ctx: StepContext,
        kv_caches: Sequence[LayerCache],
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage (see interfaces.CausalLM.forward)."""
        if hidden is None:
            assert input_ids is not None
            hidden = self.embed_input_ids(input_ids)
        contexts = self.layer_contexts(ctx)
        for layer, layer_ctx, kv_cache in zip(self.layers, contexts, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, layer_ctx, kv_cache)
        if self.norm is not None:
            hidden, _ = self.norm.add_and_norm(hidden, residual)
            return hidden, None
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [N, vocab_size] on every TP rank of the last stage."""
        assert self.lm_head is not None
        logits = self.lm_head.all_gather_logits(self.lm_head(hidden))
        return logits.float() if logits.dtype != torch.float32 else logits.contiguous()

    def process_weights_after_loading(self) -> None:
        """After loading: every linear layer's method repacks its weight (oneDNN on CPU); the
        LM head too, keeping the dense copy the tied embedding still reads (a quantized LM head
        was packed as it loaded)."""
        for _, layer in linear_layers(self):
            layer.process_weights_after_loading()
        if self.lm_head is not None:
            self.lm_head.pack(
                keep_dense=self.embed_tokens is not None
                and self.lm_head.weight is self.embed_tokens.weight
            )

    def target_path(self, target: WeightTarget) -> str | None:
        """Our module path for `target`, or None when it belongs to another stage (or is tied)."""
        if target.layer is None:
            module = getattr(self, target.module, None)
            if module is None:
                return None
            is_tied = (
                target.module == "lm_head"
                and self.embed_tokens is not None
                and (self.config.tie_word_embeddings)
            )
            return None if is_tied else target.module
        start, end = self.layer_range
        if not start <= target.layer < end:
            return None
        return f"layers.{target.layer - start}.{target.module}"

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        """Where checkpoint tensor `name` goes (empty: ignored); ValueError if it fits nowhere."""
        return resolve_weight_name(name, self.config.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Load the checkpoint tensors this shard needs; raise if a parameter stays unset."""
        parts: dict[str, set[int]] = {}
        for name, source in weights:
            for target in self.resolve_weight_name(name):
                path = self.target_path(target)
                if path is None:
                    continue
                module = self.get_submodule(path)
                view = source if target.rows is None else row_range(source, *target.rows)
                module.load(target.param, view, target.part)  # type: ignore[operator]
                parts.setdefault(f"{path}.{target.param}", set()).add(target.part)
        check_complete(self, parts, tied={"lm_head.weight": "embed_tokens.weight"})


def check_complete(
    model: nn.Module, parts: dict[str, set[int]], tied: Mapping[str, str] | None = None
) -> None:
    """Raise unless every parameter of `model` got all its fused parts (`parts`: parameter path
    -> the parts loaded); a parameter `tied` to a loaded one needs none of its own."""
    missing = []
    for path, module in model.named_modules():
        num_parts = getattr(module, "num_parts", None)
        for param, _ in module.named_parameters(prefix=path, recurse=False):
            if tied and tied.get(param) in parts:
                continue
            name = param.rsplit(".", 1)[-1]
            expected = num_parts(name) if num_parts else len(getattr(module, "part_sizes", [0]))
            if len(parts.get(param, ())) < expected:
                missing.append(param)
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing))}")
