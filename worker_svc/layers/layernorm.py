"""LayerNorm with a bias (BERT's), and a small replicated embedding table (BERT's positions and
token types): the parameters every TP rank holds whole, loaded from checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.tensor_source import TensorSource, copy_checked


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dimension (torch's
    layer_norm, as transformers' BERT runs it)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.normalized_shape = (size,)
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(getattr(self, param_name), source[:], param_name)


class ReplicatedEmbedding(nn.Module):
    """A lookup table every rank holds whole (BERT's position and token-type embeddings: a few
    hundred rows, not worth splitting over the TP ranks)."""

    def __init__(
        self, num_rows: int, size: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(num_rows, size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, source[:], param_name)
