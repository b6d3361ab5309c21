"""Rotary position embedding (neox layout: the two halves of each head rotate together).

The inverse frequencies follow transformers' `default`, `linear` and `llama3` rope types bit
for bit. cos/sin are tabulated once per position at load time and gathered once per step, so
the decoder layers only multiply.
"""

from __future__ import annotations

import math

import torch

from worker_svc.models.model_config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, scaled as `rope.rope_type` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Tabulated cos/sin [max_positions, head_dim / 2] in the compute dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.half_dim = head_dim // 2
        inv_freq = inverse_frequencies(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos_cache = freqs.cos().to(dtype=dtype, device=device)
        self.sin_cache = freqs.sin().to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [num_tokens, 1, head_dim] of the step's positions, once per step:
        (cos | cos) and (-sin | sin), so that `apply` is three kernels per call.

        Positions must be below `max_positions` (>= max_model_len, which the input batch
        enforces on the host).
        """
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(
            1
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [num_tokens, num_heads, head_dim]; q and k may be rotated together.

        x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2 | x1), i.e. (x2 | x1) times
        the signed sin."""
        swapped = torch.cat((x[..., self.half_dim :], x[..., : self.half_dim]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
