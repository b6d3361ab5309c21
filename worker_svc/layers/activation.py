"""Gated activations of the MLPs: SiLU (Llama family), tanh-approximated GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where `gate_up` is [..., 2 * d] with gate first (the fused gate_up_proj)."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]).mul_(gate_up[..., d:])


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh), gate first in `gate_up`."""
    d = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :d], approximate="tanh").mul_(gate_up[..., d:])
