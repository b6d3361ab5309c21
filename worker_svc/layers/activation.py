"""Gated activations of the MLPs: SiLU (Llama family), tanh-approximated GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.kernels.cpu_kernels import is_rows
from worker_svc.layers.custom_op import CustomOp


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where `gate_up` is [..., 2 * d] with gate first (the fused gate_up_proj)."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]).mul_(gate_up[..., d:])


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh), gate first in `gate_up`."""
    d = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :d], approximate="tanh").mul_(gate_up[..., d:])


class SiluAndMul(CustomOp):
    """`silu_and_mul` as an op; built with the CPU kernels, 2-D rows take the fused kernel."""

    has_cpu_kernels = True

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def forward_cpu_kernels(self, gate_up: torch.Tensor) -> torch.Tensor:
        if is_rows(gate_up):
            return self.kernels.silu_and_mul(gate_up)
        return silu_and_mul(gate_up)


class GeluTanhAndMul(CustomOp):
    """`gelu_tanh_and_mul` as an op (no kernel of its own)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)


ACTIVATIONS: dict[str, type[CustomOp]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
"""The gated MLP activation of each `hidden_act` the models serve."""
