"""Rotary position embedding: the neox layout (the two halves of the rotated part rotate
together) or the GPT-J one (adjacent pairs; `RopeConfig.is_neox_style` False, GLM-4).

The inverse frequencies follow transformers' `default`, `linear`, `llama3`, `yarn`, `dynamic`
and `longrope` rope types bit for bit; yarn and longrope also scale cos and sin by their
attention factor. cos/sin are tabulated once per position at load time and gathered once per
step, so the decoder layers only multiply. With a `partial_rotary_factor` (Phi-4-mini) only the
first part of each head rotates.

transformers recomputes `dynamic` and `longrope` frequencies from each forward's sequence
length, which a paged KV cache cannot follow (cached keys keep their rotation). Here the served
context length `context_len` (max_model_len) fixes them once: dynamic NTK scales its base for
context_len (no scaling within max_position_embeddings, as transformers), longrope takes its long
factors when context_len exceeds original_max_position_embeddings, its short ones otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from worker_svc.layers.custom_op import CustomOp
from worker_svc.layers.rope_config import RopeConfig


def inverse_frequencies(
    head_dim: int, rope: RopeConfig, context_len: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, scaled as `rope.rope_type` says;
    `head_dim` is the rotated width, `context_len` the served context (dynamic, longrope)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    if rope.rope_type == "dynamic":
        return 1.0 / (_dynamic_ntk_base(head_dim, rope, context_len) ** exponents)
    if rope.rope_type == "longrope":
        return 1.0 / (_longrope_factors(rope, context_len) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaling(head_dim, rope)
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """The factor on cos and sin: yarn's mscale ratio, longrope's sqrt(1 + ln s / ln L)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        return yarn_mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1.0:
        return math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings)
        )
    return 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's mscale of a scaling `factor` (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaling(dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp
    linearly in between (the band set by beta_fast / beta_slow rotations)."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


def _dynamic_ntk_base(dim: int, rope: RopeConfig, context_len: int | None) -> float:
    """transformers' dynamic NTK base for a sequence of `context_len` tokens (unchanged up to
    max_position_embeddings)."""
    max_positions = rope.max_position_embeddings
    seq_len = max(context_len or max_positions, max_positions)
    stretch = (rope.factor * seq_len / max_positions) - (rope.factor - 1)
    return float(rope.theta * stretch ** (dim / (dim - 2)))


def _longrope_factors(rope: RopeConfig, context_len: int | None) -> torch.Tensor:
    """The long factors when the served context exceeds the original one, else the short."""
    is_long = context_len is not None and context_len > rope.original_max_position_embeddings
    return torch.tensor(rope.long_factor if is_long else rope.short_factor, dtype=torch.float32)


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


class RotaryEmbedding(CustomOp):
    """Tabulated cos/sin [max_positions, rotary_dim / 2] in the compute dtype (plain tensors,
    not buffers: they are not weights). Calling it rotates q and k together, in place where
    the CPU kernels can (built with them)."""

    has_cpu_kernels = True

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.is_partial = self.rotary_dim < head_dim
        self.half_dim = self.rotary_dim // 2
        self.is_neox_style = rope.is_neox_style
        inv_freq = inverse_frequencies(self.rotary_dim, rope, context_len or max_positions)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        scaling = attention_scaling(rope)
        self.cos_cache = (freqs.cos() * scaling).to(dtype=dtype, device=device)
        self.sin_cache = (freqs.sin() * scaling).to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [num_tokens, 1, head_dim] of the step's positions, once per step:
        (cos | cos) and (-sin | sin), so that `rotate` is three kernels per call.

        Positions must be below `max_positions` (>= max_model_len, which the input batch
        enforces on the host).
        """
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        if not self.is_neox_style:  # (c0 c0 c1 c1 ..) and (-s0 s0 -s1 s1 ..)
            signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
            return cos.repeat_interleave(2, dim=-1).unsqueeze(1), signed.unsqueeze(1)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(
            1
        )

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [num_tokens, num_heads, head_dim]; q and k may be rotated together.

        x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2 | x1), i.e. (x2 | x1) times
        the signed sin. A partial rotary passes the rest of each head through."""
        if self.is_partial:
            rotated = self._rotate_full(x[..., : self.rotary_dim], cos, sin)
            return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)
        return self._rotate_full(x, cos, sin)

    def forward_native(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The rotated `x` (`rotate`); `positions` are for the kernels' version."""
        return self.rotate(x, cos, sin)

    def forward_cpu_kernels(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Rotates in place where `positions` are given and x [tokens, heads, head_dim] has
        contiguous heads (e.g. a slice of the fused qkv output); returns the rotated tensor."""
        if positions is None or x.stride(2) != 1 or not self.is_neox_style:
            return self.rotate(x, cos, sin)
        self.kernels.rotary_neox_(x, positions, self.cos_cache, self.sin_cache, self.rotary_dim)
        return x

    def _rotate_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            swapped = torch.cat((x[..., self.half_dim :], x[..., : self.half_dim]), dim=-1)
        else:  # each adjacent pair swapped: (x1 x0 x3 x2 ..)
            swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return torch.addcmul(x * cos, swapped, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL's multimodal rope): each token has three positions (temporal, height,
    width), and the rotated frequencies are cut into `mrope_section` runs, run i rotating by
    position row i. Text tokens have three equal positions, which is plain rope; one row of
    positions [num_tokens] is taken as that."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        context_len: int | None = None,
    ) -> None:
        super().__init__(
            head_dim, max_positions, rope, dtype=dtype, device=device, context_len=context_len
        )
        if sum(rope.mrope_section) != self.half_dim or len(rope.mrope_section) != 3:
            raise ValueError(
                f"mrope_section {list(rope.mrope_section)} must be three runs summing to "
                f"{self.half_dim} (half the rotated head width)"
            )
        row = torch.repeat_interleave(torch.arange(3), torch.tensor(rope.mrope_section))
        self.row_of_frequency = row.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As RotaryEmbedding's, from positions [3, num_tokens] (or [num_tokens])."""
        if positions.dim() == 1:
            return super().cos_sin(positions)
        columns = torch.arange(self.half_dim, device=positions.device)
        picked = positions[self.row_of_frequency].T  # [num_tokens, half]: frequency j's row
        cos, sin = self.cos_cache[picked, columns], self.sin_cache[picked, columns]
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(
            1
        )

    def forward_cpu_kernels(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The kernels rotate by one position row; M-RoPE rotates by the gathered cos/sin."""
        return self.rotate(x, cos, sin)


class NoPositionEmbedding(nn.Module):
    """NoPE: a layer whose queries and keys are not rotated (SmolLM3's every fourth layer);
    it stands where a `RotaryEmbedding` would."""

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        return x

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x


Rotation = RotaryEmbedding | MRotaryEmbedding | NoPositionEmbedding
"""What a layer's attention positions its queries and keys with."""
