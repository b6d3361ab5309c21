"""A generative family served as a pooling model (vLLM's model_executor/models/adapters.py,
`as_embedding_model`): the same decoder without its LM head; the runner pools the final hidden
states (worker_svc/pooler.py) instead of computing logits.

It reads both a full causal-LM checkpoint (`--convert embed`: the LM head's tensors are skipped)
and a bare decoder (what sentence-transformers saves: transformers' AutoModel, `LlamaModel`,
tensors named without the "model." prefix)."""

from __future__ import annotations

from typing import Any

import torch

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
