"""What a vision-language model (LLaVA, Qwen2.5-VL) passes on to its language model unchanged:
the embeddings, the forward (the images are in the embeddings already), the logits, the weights'
post-processing and their module paths."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.weight_names import WeightTarget


class WrapsLanguageModel(nn.Module):
    """A model whose text half is `language_model` (set by the subclass's constructor)."""

    language_model: LlamaForCausalLM

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The language model's forward (the images are in the embeddings already)."""
        return self.language_model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def process_weights_after_loading(self) -> None:
        self.language_model.process_weights_after_loading()

    def target_path(self, target: WeightTarget) -> str | None:
        path = self.language_model.target_path(target)
        return None if path is None else f"language_model.{path}"
