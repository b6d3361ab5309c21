"""What a model shard offers the worker, as protocols (vLLM's model_executor/models/interfaces.py).

The worker, the model runner and the encoder runner know models only through these: the
registry (models/registry.py) maps an architecture to a class that is a `CausalLM`, and the
runners ask a model what else it supports (`supports_images`) instead of naming a family.

The hooks the next features build on are part of `CausalLM`:
- quantized linear layers: every linear layer is a `layers.linear.LinearBase` whose method a
  `LinearMethods` picks by module path when the model is built (`BuildContext.linear_methods`);
  `layers.linear.linear_layers(model)` enumerates them with their paths;
- LoRA: the same paths, and `packed_modules_mapping`, which checkpoint projections each fused
  layer holds (as vLLM's packed_modules_mapping: an adapter for q_proj lands in qkv_proj);
- speculative decoding: `forward` returns the last stage's final hidden states and
  `compute_logits` maps them to logits, so a draft head (EAGLE, MTP) takes the hidden states of
  the sampled positions and `embed_input_ids` of the tokens it continues from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeGuard, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from worker_svc.attention.backend import AttentionInputs
from worker_svc.layers.state_cache import LayerCache, StateSpec
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget

if TYPE_CHECKING:
    from worker_svc.models.decoder import BuildContext, StepContext


@runtime_checkable
class CausalLM(Protocol):
    """One pipeline stage of a causal language model, sharded over its tensor-parallel group."""

    @property
    def config(self) -> ModelConfig:
        """The checkpoint's facts (a family's subclass of ModelConfig)."""
        ...

    @property
    def layer_range(self) -> tuple[int, int]:
        """The decoder layers [start, end) this stage holds."""
        ...

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]]
    """Fused layer name -> the checkpoint projections it holds, in order."""

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        """Build the shard; `prefix` is its module path inside an enclosing model."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        """The ModelConfig of a checkpoint's transformers configuration (refusing what the
        family cannot serve)."""
        ...

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        """What every layer reads in a step (rotary cos/sin, attention metadata)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's token embeddings [tokens, hidden] (what `forward` starts from)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor | None,
        ctx: StepContext,
        kv_caches: Sequence[LayerCache],
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage. The first stage embeds `input_ids` unless given their embeddings as
        `hidden`; later stages continue from the previous stage's (hidden, residual). The last
        stage returns (final hidden states, None)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [N, vocab_size] on every TP rank of the last stage."""
        ...

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        """Where checkpoint tensor `name` goes (empty: ignored); ValueError if it fits nowhere."""
        ...

    def target_path(self, target: WeightTarget) -> str | None:
        """Our module path for `target`, or None when this shard does not hold it."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Load the checkpoint tensors this shard needs; raise if a parameter stays unset."""
        ...

    def process_weights_after_loading(self) -> None:
        """Bring loaded weights into the form the device runs fastest (oneDNN packing on CPU)."""
        ...

    # nn.Module's, which every model is:
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def eval(self) -> Any: ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def modules(self, remove_duplicate: bool = True) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...


@runtime_checkable
class SupportsImages(Protocol):
    """A model whose prompts may carry images (vLLM's SupportsMultiModal): each image is pixel
    values (and, for dynamic-resolution encoders, a patch grid) that `encode_images` turns into
    embedding rows, which replace the rows of its placeholder tokens in `embed_input_ids`."""

    supports_images: ClassVar[Literal[True]]

    @property
    def max_image_tokens(self) -> int:
        """Most placeholder tokens (= embedding rows) one image may take."""
        ...

    def image_problem(
        self, shape: tuple[int, ...], grid_thw: tuple[int, ...], num_tokens: int
    ) -> str | None:
        """Why pixel values of `shape` with patch grid `grid_thw` (empty: none) cannot be an
        image of `num_tokens` placeholders for this model, or None."""
        ...

    def encode_images(
        self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Embeddings [num_tokens, hidden] of each image (checked by `image_problem`)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SupportsMRope(Protocol):
    """A model whose rotary embedding takes three position rows (M-RoPE, Qwen2-VL): its
    images' placeholders get 2D positions and the text after an image continues past them
    (vLLM's SupportsMRoPE)."""

    uses_mrope: ClassVar[Literal[True]]

    def mrope_positions(
        self, num_prompt_tokens: int, images: Sequence[tuple[int, tuple[int, ...]]]
    ) -> tuple[npt.NDArray[np.int64], int]:
        """Positions [3, num_prompt_tokens] of a prompt whose images (first placeholder, grid)
        are `images`, and the delta of every later token (position + delta on all rows)."""
        ...


def uses_mrope(model: object) -> TypeGuard[SupportsMRope]:
    """Whether `model` positions its tokens with M-RoPE."""
    return getattr(model, "uses_mrope", False) is True and isinstance(model, SupportsMRope)


def supports_images(model: object) -> TypeGuard[SupportsImages]:
    """Whether `model` takes images (and so needs the encoder runner)."""
    return getattr(model, "supports_images", False) is True and isinstance(model, SupportsImages)


@runtime_checkable
class EncoderOnly(Protocol):
    """A bidirectional encoder (BERT-style; vLLM's encoder-only attention): every token of a
    prompt attends to the whole prompt, so a prompt runs whole, in one step, and the model
    attends without the paged KV cache (`attention_metadata` replaces the backend's): a request
    keeps no KV after its step."""

    is_encoder_only: ClassVar[Literal[True]]

    def attention_metadata(self, inputs: AttentionInputs) -> object:
        """The step's attention metadata, from its host-side layout."""
        ...


def is_encoder_only(model: object) -> TypeGuard[EncoderOnly]:
    """Whether `model` (or a model class) is an encoder-only model."""
    return getattr(model, "is_encoder_only", False) is True


@runtime_checkable
class IsHybrid(Protocol):
    """A model some of whose layers keep a fixed-size state per request instead of KV (vLLM's
    IsHybrid: Mamba2, gated DeltaNet layers beside attention layers). `state_specs` has one
    entry per layer of this pipeline stage: the layer's StateSpec, or None for an attention
    layer, which keeps paged KV. The forward's per-layer caches follow that list: a state
    layer gets its state tensors (layers/state_cache.py), an attention layer its KV tensor."""

    is_hybrid: ClassVar[Literal[True]]

    @property
    def state_specs(self) -> Sequence[StateSpec | None]: ...


def is_hybrid(model: object) -> TypeGuard[IsHybrid]:
    """Whether `model` (or a model class) has state layers."""
    return getattr(model, "is_hybrid", False) is True
