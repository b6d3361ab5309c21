"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as one decoder built from our layers.

Flavours differ only in flags of `ModelConfig`: Qwen2 biases q/k/v, Qwen3 RMS-normalises q and
k per head before the rotary embedding, Llama 3.1 scales its rotary frequencies, Mistral's
layers attend within a sliding window. q/k/v and gate/up are fused into single matmuls at load
time. Other families subclass `LlamaForCausalLM` and swap pieces: the MLP (`_make_mlp`, the
mixture-of-experts models) and the checkpoint's tensor names (`resolve_weight_name`, Phi-3).

Pipeline parallelism: a stage owns the contiguous layer range `layer_range`; the first stage
embeds tokens, the last normalises and owns the LM head. Between stages travel the hidden
states and the residual stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend, AttentionOptions
from worker_svc.distributed import ParallelState
from worker_svc.kernels.cpu_kernels import CpuKernels, is_rows
from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    kv_heads_per_rank,
)
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.layers.tensor_source import TensorSource, row_range
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget, resolve_weight_name


@dataclass(frozen=True, slots=True)
class StepContext:
    """Per-step values shared by every layer: rotary cos/sin of the positions, attention indices."""

    cos: torch.Tensor
    sin: torch.Tensor
    attn_metadata: object
    positions: torch.Tensor | None = None  # the step's positions (the CPU kernels rotate by them)


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Contiguous layers [start, end) of pipeline stage `pp_rank`; earlier stages take the extras."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, rotary, paged attention, row-parallel o_proj."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads = config.num_heads // parallel.tp_size
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, parallel.tp_size)
        self.head_dim = d
        self.backend = backend
        self.rotary = rotary
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            d,
            bias=config.qkv_bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d,
            config.hidden_size,
            bias=config.o_bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden).view(num_tokens, h + 2 * kvh, d)
        value = qkv[:, h + kvh :]
        if self.q_norm is not None and self.k_norm is not None:
            query = self.rotary.apply(self.q_norm(qkv[:, :h]), ctx.cos, ctx.sin)
            key = self.rotary.apply(self.k_norm(qkv[:, h : h + kvh]), ctx.cos, ctx.sin)
        else:  # q and k together, in place where the CPU kernels are loaded
            rotated = self.rotary.apply_(qkv[:, : h + kvh], ctx.positions, ctx.cos, ctx.sin)
            query, key = rotated[:, :h], rotated[:, h:]
        out = self.backend.forward(query, key, value, kv_cache, ctx.attn_metadata)
        return self.o_proj(out.reshape(num_tokens, h * d))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused; with `kernels` (CPU) the activation
    is one fused kernel."""

    kernels: CpuKernels | None = None

    def __init__(
        self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [inter, inter],
            bias=config.mlp_bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=config.mlp_bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and is_rows(gate_up):
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, parallel, backend, rotary, dtype, device)
        self.mlp = LlamaMLP(config, parallel, dtype, device) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, ctx, kv_cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a Llama-family causal LM, sharded over the TP group."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.layer_range = stage_layer_range(config.num_layers, parallel.pp_rank, parallel.pp_size)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max_positions,
            config.rope,
            dtype=dtype,
            device=device,
            context_len=context_len,
        )
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel=parallel, dtype=dtype, device=device
            )
            if parallel.is_first_stage
            else None
        )
        self.layers: list[LlamaDecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            self._make_layer(i, backend.with_options(self.attention_options(i)), dtype, device)
            for i in range(*self.layer_range)
        )
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if parallel.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, parallel=parallel, dtype=dtype, device=device
            )
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def attention_options(self, layer: int) -> AttentionOptions:
        """How decoder layer `layer` attends (its sliding window, Gemma's scale and soft cap)."""
        config = self.config
        return AttentionOptions(
            sliding_window=config.layer_window(layer),
            logits_soft_cap=config.attn_logit_softcapping,
            scale=config.attn_scale,
        )

    def _make_layer(
        self, layer: int, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> LlamaDecoderLayer:
        """Decoder layer `layer`, attending through `backend` (already given its options)."""
        mlp = self._make_mlp(layer, dtype, device)
        return LlamaDecoderLayer(
            self.config, self.parallel, backend, self.rotary, dtype, device, mlp=mlp
        )

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        """The MLP of decoder layer `layer`; None = the dense Llama MLP."""
        return None

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        cos, sin = self.rotary.cos_sin(positions)
        return StepContext(cos, sin, attn_metadata, positions)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run RMSNorm, rotary and SiLU-and-mul through the CPU kernels (after loading)."""
        self.rotary.kernels = kernels
        for module in self.modules():
            if isinstance(module, RMSNorm) or type(module) is LlamaMLP:
                module.kernels = kernels

    def forward(
        self,
        input_ids: torch.Tensor | None,
        ctx: StepContext,
        kv_caches: list[torch.Tensor],
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage. The first stage embeds `input_ids` (unless given their embeddings as
        `hidden`: multimodal prompts); later stages continue from the previous stage's (hidden,
        residual). The last stage returns normalised hidden states."""
        if hidden is None:
            assert self.embed_tokens is not None and input_ids is not None
            hidden = self.embed_tokens(input_ids)
        assert hidden is not None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, ctx, kv_cache)
        if self.norm is not None:
            hidden, _ = self.norm.add_and_norm(hidden, residual)
            return hidden, None
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [N, vocab_size] on every TP rank of the last stage."""
        assert self.lm_head is not None
        logits = self.lm_head.all_gather_logits(self.lm_head(hidden))
        return logits.float() if logits.dtype != torch.float32 else logits.contiguous()

    def pack_weights(self) -> None:
        """After loading: switch every matmul to oneDNN-packed weights where available (CPU)."""
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.pack()
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
        self._check_complete(parts)

    def _check_complete(self, parts: dict[str, set[int]]) -> None:
        missing = []
        for path, module in self.named_modules():
            num_parts = getattr(module, "num_parts", None)
            for param, _ in module.named_parameters(prefix=path, recurse=False):
                if param == "lm_head.weight" and "embed_tokens.weight" in parts:
                    continue
                name = param.rsplit(".", 1)[-1]
                expected = num_parts(name) if num_parts else len(getattr(module, "part_sizes", [0]))
                if len(parts.get(param, ())) < expected:
                    missing.append(param)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing))}")
