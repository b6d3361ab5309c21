"""Gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where `gate_up` is [..., 2 * d] with gate first (the fused gate_up_proj)."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]).mul_(gate_up[..., d:])
