"""A generative family served as a pooling model (vLLM's model_executor/models/adapters.py,
`as_embedding_model`): the same decoder without its LM head; the runner pools the final hidden
states (worker_svc/runner/pooler.py) instead of computing logits.

It reads both a full causal-LM checkpoint (`--convert embed`: the LM head's tensors are skipped)
and a bare decoder (what sentence-transformers saves: transformers' AutoModel, `LlamaModel`,
tensors named without the "model." prefix)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.interfaces import CausalLM
from worker_svc.models.weight_names import WeightTarget

_DECODER_PREFIX = "model."


def as_embedding_model(cls: type[CausalLM]) -> type[CausalLM]:
    """`cls` (a DecoderForCausalLM) without its LM head, reading checkpoints with or without
    one."""

    def __init__(self: Any, build: Any, prefix: str = "") -> None:
        cls.__init__(self, build, prefix)
        self.lm_head = None  # no logits: the hidden states are the output

    def resolve_weight_name(self: Any, name: str) -> list[WeightTarget]:
        if name.startswith("lm_head."):
            return []
        if not name.startswith(_DECODER_PREFIX):
            name = _DECODER_PREFIX + name
        targets: list[WeightTarget] = cls.resolve_weight_name(self, name)
        return [t for t in targets if t.module != "lm_head"]

    def compute_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pooling model computes no logits")

    namespace = {
        "__init__": __init__,
        "resolve_weight_name": resolve_weight_name,
        "compute_logits": compute_logits,
        "__doc__": f"{cls.__name__} as a pooling model (no LM head).",
    }
    adapted: type[CausalLM] = type(f"{cls.__name__}ForEmbedding", (cls,), namespace)
    return adapted


def as_seq_cls_model(cls: type[CausalLM], num_labels: int) -> type[CausalLM]:
    """`cls` with transformers' sequence-classification head (`score`, no bias) instead of the
    LM head (vLLM's as_seq_cls_model): `pool_head` maps the pooled last-token state to the
    labels' scores, through a sigmoid for one label (a cross-encoder's relevance)."""
    base = as_embedding_model(cls)

    def __init__(self: Any, build: Any, prefix: str = "") -> None:
        base.__init__(self, build, prefix)
        shape = (num_labels, build.config.hidden_size)
        # A buffer: the decoder's completeness check covers parameters; load_weights checks it.
        self.register_buffer(
            "score_weight", torch.zeros(shape, dtype=build.dtype, device=build.device)
        )
        self._has_score = False

    def resolve_weight_name(self: Any, name: str) -> list[WeightTarget]:
        return [] if name == "score.weight" else base.resolve_weight_name(self, name)

    def load_weights(self: Any, weights: Iterable[tuple[str, TensorSource]]) -> None:
        def decoder_weights() -> Iterator[tuple[str, TensorSource]]:
            for name, source in weights:
                if name == "score.weight":
                    self.score_weight.copy_(source[:])
                    self._has_score = True
                yield name, source

        base.load_weights(self, decoder_weights())
        if not self._has_score:
            raise ValueError("checkpoint lacks tensors for: score.weight")

    def pool_head(self: Any, pooled: torch.Tensor) -> torch.Tensor:
        weight = self.score_weight
        scores = torch.nn.functional.linear(pooled.to(weight.dtype), weight).float()
        return torch.sigmoid(scores) if scores.shape[-1] == 1 else scores

    namespace = {
        "__init__": __init__,
        "resolve_weight_name": resolve_weight_name,
        "load_weights": load_weights,
        "pool_head": pool_head,
        "__doc__": f"{cls.__name__} with a sequence-classification head.",
    }
    adapted: type[CausalLM] = type(f"{cls.__name__}ForSequenceClassification", (base,), namespace)
    return adapted
