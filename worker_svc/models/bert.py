"""BERT as an embedding model (transformers' BertModel: the architecture of bge-small,
gte-small, e5-small, all-MiniLM), served for pooling only.

An encoder, not a decoder: word + absolute position + token-type embeddings, then a LayerNorm;
each layer is post-norm (LayerNorm(x + attention(x)), then LayerNorm(x + MLP(x))) with biased
projections and a GELU MLP; attention is bidirectional over the whole prompt
(attention/encoder_only.py), without the paged KV cache. Every prompt is one segment (token
type 0), as sentence-transformers encodes single texts. q/k/v are fused into one column-parallel
matmul and the output projections are row-parallel, as the Llama layers, so the heads and the
MLP split over the TP ranks; one pipeline stage only.

Checkpoint names: transformers' (`embeddings.*`, `encoder.layer.N.*`), with or without the
`bert.` prefix of the task models; the NSP pooler (`pooler.*`) and MLM head (`cls.*`) are not
part of an embedding and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.attention.backend import AttentionInputs
from worker_svc.attention.encoder_only import (
    EncoderAttentionMetadata,
    build_encoder_metadata,
    encoder_attention,
)
from worker_svc.layers.embedding import VocabParallelEmbedding
from worker_svc.layers.layernorm import LayerNorm, ReplicatedEmbedding
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear_layers,
)
from worker_svc.layers.rope_config import RopeConfig
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.decoder import BuildContext, StepContext, check_complete, join_prefix
from worker_svc.models.model_config import (
    ModelConfig,
    architecture_of,
    checkpoint_dtype_of,
    refuse_quantization,
)
from worker_svc.models.weight_names import WeightTarget

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
"""BERT's hidden_act -> F.gelu's `approximate`."""
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
_PARAMS = {"gamma": "weight", "beta": "bias"}  # LayerNorm names of TF-converted checkpoints
_LAYER_MODULES: dict[str, tuple[str, int]] = {
    "attention.self.query": ("attention.qkv_proj", 0),
    "attention.self.key": ("attention.qkv_proj", 1),
    "attention.self.value": ("attention.qkv_proj", 2),
    "attention.output.dense": ("attention.o_proj", 0),
    "attention.output.LayerNorm": ("attention_norm", 0),
    "intermediate.dense": ("up_proj", 0),
    "output.dense": ("down_proj", 0),
    "output.LayerNorm": ("mlp_norm", 0),
}
_EMBEDDING_MODULES = frozenset(
    f"embeddings.{name}"
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "norm")
)
_SKIPPED = ("pooler.", "cls.", "embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(frozen=True, slots=True)
class BertConfig(ModelConfig):
    """BERT's knobs beyond the shape (`rms_norm_eps` holds its layer_norm_eps)."""

    activations: ClassVar[tuple[str, ...]] = tuple(_GELU)
    type_vocab_size: int = 2

    @classmethod
    def read(cls, hf: Any) -> BertConfig:
        refuse_quantization(hf)
        kind = getattr(hf, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported; only absolute")
        act = str(getattr(hf, "hidden_act", "gelu"))
        if act not in _GELU:
            raise ValueError(f"hidden_act {act!r} is not supported for BERT; one of {list(_GELU)}")
        num_heads, max_positions = int(hf.num_attention_heads), int(hf.max_position_embeddings)
        return cls(
            architecture=architecture_of(hf),
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=int(hf.hidden_size) // num_heads,
            rms_norm_eps=float(hf.layer_norm_eps),
            max_position_embeddings=max_positions,
            rope=RopeConfig(max_position_embeddings=max_positions),  # unused: no rotary
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            checkpoint_dtype=checkpoint_dtype_of(hf),
            hidden_act=act,
            type_vocab_size=int(getattr(hf, "type_vocab_size", 2)),
        )


class BertEmbeddings(nn.Module):
    """LayerNorm(word + position + token type 0), the word table split over the TP ranks."""

    def __init__(self, build: BuildContext, config: BertConfig) -> None:
        super().__init__()
        dtype, device, size = build.dtype, build.device, config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, size, parallel=build.parallel, dtype=dtype, device=device
        )
        positions = config.max_position_embeddings
        self.position_embeddings = ReplicatedEmbedding(positions, size, dtype=dtype, device=device)
        types = config.type_vocab_size
        self.token_type_embeddings = ReplicatedEmbedding(types, size, dtype=dtype, device=device)
        self.norm = LayerNorm(size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, words: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`words`: the word embeddings of the step's tokens."""
        hidden = words + self.token_type_embeddings.weight[0]
        return self.norm(hidden + self.position_embeddings(positions))


class BertAttention(nn.Module):
    """Fused biased q/k/v, bidirectional attention within each prompt, the output dense."""

    def __init__(self, build: BuildContext, prefix: str) -> None:
        super().__init__()
        config = build.config
        self.num_heads = config.num_heads // build.parallel.tp_size
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_heads,
            config.head_dim,
            bias=True,
            **build.linear_args(join_prefix(prefix, "qkv_proj")),
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=True,
            **build.linear_args(join_prefix(prefix, "o_proj")),
        )

    def forward(self, hidden: torch.Tensor, metadata: EncoderAttentionMetadata) -> torch.Tensor:
        num_tokens, h, d = hidden.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(hidden).view(num_tokens, 3 * h, d)
        out = encoder_attention(
            qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :], metadata, self.scale
        )
        return self.o_proj(out.reshape(num_tokens, h * d))


class BertLayer(nn.Module):
    """Post-norm: x = LayerNorm(x + attention(x)); x = LayerNorm(x + down(gelu(up(x))))."""

    def __init__(self, build: BuildContext, prefix: str) -> None:
        super().__init__()
        config, dtype, device = build.config, build.dtype, build.device
        size, eps = config.hidden_size, config.rms_norm_eps
        self.attention = BertAttention(build, join_prefix(prefix, "attention"))
        self.attention_norm = LayerNorm(size, eps, dtype=dtype, device=device)
        self.up_proj = ColumnParallelLinear(
            size,
            [config.intermediate_size],
            bias=True,
            **build.linear_args(join_prefix(prefix, "up_proj")),
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            size,
            bias=True,
            **build.linear_args(join_prefix(prefix, "down_proj")),
        )
        self.mlp_norm = LayerNorm(size, eps, dtype=dtype, device=device)
        self.approximate = _GELU[config.hidden_act]

    def forward(self, hidden: torch.Tensor, metadata: EncoderAttentionMetadata) -> torch.Tensor:
        hidden = self.attention_norm(self.attention(hidden, metadata) + hidden)
        mlp = self.down_proj(F.gelu(self.up_proj(hidden), approximate=self.approximate))
        return self.mlp_norm(mlp + hidden)


class BertModel(nn.Module):
    """The BERT encoder (an `interfaces.CausalLM` that computes no logits, and
    `interfaces.EncoderOnly`): its final hidden states are what the pooler reads."""

    is_encoder_only: ClassVar[Literal[True]] = True
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "qkv_proj": ("query", "key", "value")
    }

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__()
        config = build.config
        if not isinstance(config, BertConfig):
            raise TypeError("BertModel is built from a BertConfig")
        if build.parallel.pp_size > 1:
            raise ValueError("BERT runs in one pipeline stage: serve it with PP = 1")
        self.config = config
        self.device = build.device
        self.layer_range = (0, config.num_layers)
        self.embeddings = BertEmbeddings(build, config)
        self.layers = nn.ModuleList(
            BertLayer(build, join_prefix(prefix, f"layers.{i}")) for i in range(config.num_layers)
        )

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return BertConfig.read(hf)

    def attention_metadata(self, inputs: AttentionInputs) -> EncoderAttentionMetadata:
        return build_encoder_metadata(inputs, self.device)

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        no_rope = positions.new_empty(0, dtype=torch.float32)
        return StepContext(no_rope, no_rope, attn_metadata, positions)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        ctx: StepContext,
        kv_caches: list[torch.Tensor],
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states of the step's prompts; `kv_caches` are not used."""
        if hidden is None:
            assert input_ids is not None
            hidden = self.embed_input_ids(input_ids)
        assert ctx.positions is not None and isinstance(ctx.attn_metadata, EncoderAttentionMetadata)
        hidden = self.embeddings(hidden, ctx.positions)
        for layer in self.layers:
            hidden = layer(hidden, ctx.attn_metadata)
        return hidden, None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder-only model computes no logits")

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        name = name.removeprefix("bert.")
        if name.startswith(_SKIPPED):
            return []
        if name.startswith("embeddings."):
            module, _, param = name.rpartition(".")
            module = module.replace("LayerNorm", "norm")
            if module in _EMBEDDING_MODULES:
                return [WeightTarget(None, module, _PARAMS.get(param, param))]
        match = _LAYER.match(name)
        if match and match.group(2) in _LAYER_MODULES:
            module, part = _LAYER_MODULES[match.group(2)]
            param = _PARAMS.get(match.group(3), match.group(3))
            return [WeightTarget(int(match.group(1)), module, param, part)]
        raise ValueError(f"checkpoint tensor {name!r} has no place in a BERT model")

    def target_path(self, target: WeightTarget) -> str | None:
        return target.module if target.layer is None else f"layers.{target.layer}.{target.module}"

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        parts: dict[str, set[int]] = {}
        for name, source in weights:
            for target in self.resolve_weight_name(name):
                path = self.target_path(target)
                assert path is not None
                self.get_submodule(path).load(target.param, source, target.part)  # type: ignore[operator]
                parts.setdefault(f"{path}.{target.param}", set()).add(target.part)
        check_complete(self, parts)

    def process_weights_after_loading(self) -> None:
        for _, layer in linear_layers(self):
            layer.process_weights_after_loading()
