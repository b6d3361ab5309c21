"""Qwen2.5-VL's vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel), replicated
on every tensor-parallel rank of the first pipeline stage like LLaVA's CLIP.

    patches [n, C*T*P*P] --patch_embed (the Conv3d as a linear)--> [n, hidden]
        --reordered window by window (windows of merge units)--> blocks:
            RMSNorm, attention with 2D rotary (height, width), RMSNorm, SwiGLU MLP;
            blocks in `fullatt_block_indexes` attend over the whole image, the others
            within their window
        --merger (RMSNorm, merge_size^2 patches -> one row, MLP)--> back in raster order

Dynamic resolution: an image is a grid (t, h, w) of patches, h and w multiples of the merge
size; it yields t * h * w / merge_size^2 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.models.clip import vision_activation

Grid = tuple[int, int, int]
"""An image's patch grid: (temporal, height, width)."""


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """The vision side of a Qwen2.5-VL config (transformers' Qwen2_5_VLVisionConfig)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float

    @property
    def patch_width(self) -> int:
        """Values of one flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_tokens(self, grid: Grid) -> int:
        """Rows (= placeholder tokens) of an image of this grid."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2

    def grid_problem(self, grid: Sequence[int]) -> str | None:
        """Why `grid` is no valid patch grid for this tower, or None."""
        m = self.spatial_merge_size
        if len(grid) != 3 or any(int(d) <= 0 for d in grid):
            return f"grid_thw {list(grid)} is not three positive numbers"
        if grid[1] % m or grid[2] % m:
            return f"grid_thw {list(grid)}: height and width must be multiples of {m}"
        return None


def qwen_vision_config(cfg: Any) -> QwenVisionConfig:
    """The tower's config; refuses activations it does not implement."""
    act = str(getattr(cfg, "hidden_act", "silu"))
    if act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
        raise ValueError(f"Qwen2.5-VL vision hidden_act {act!r} is not supported")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    return QwenVisionConfig(
        depth=int(cfg.depth),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_heads=int(cfg.num_heads),
        out_hidden_size=int(cfg.out_hidden_size),
        in_channels=int(getattr(cfg, "in_channels", 3)),
        patch_size=int(cfg.patch_size),
        temporal_patch_size=int(cfg.temporal_patch_size),
        spatial_merge_size=int(cfg.spatial_merge_size),
        window_size=int(cfg.window_size),
        fullatt_block_indexes=tuple(int(i) for i in cfg.fullatt_block_indexes),
        hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


class VisionRMSNorm(nn.Module):
    """RMSNorm in float32 (eps 1e-6), weight applied in the input's dtype."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def _linear(
    i: int, o: int, dtype: torch.dtype, device: torch.device, bias: bool = True
) -> nn.Linear:
    return nn.Linear(i, o, bias=bias, dtype=dtype, device=device)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of `cu_seqlens`, 2D-rotated q and k."""

    def __init__(self, c: QwenVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = _linear(c.hidden_size, 3 * c.hidden_size, dtype, device)
        self.proj = _linear(c.hidden_size, c.hidden_size, dtype, device)

    def forward(
        self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32 (transformers' vision rotary)."""
    h = x.float()
    half = h.shape[-1] // 2
    swapped = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + swapped * sin).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, c: QwenVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = c.hidden_act
        self.norm1 = VisionRMSNorm(c.hidden_size, dtype, device)
        self.norm2 = VisionRMSNorm(c.hidden_size, dtype, device)
        self.attn = VisionAttention(c, dtype, device)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": _linear(c.hidden_size, c.intermediate_size, dtype, device),
                "up_proj": _linear(c.hidden_size, c.intermediate_size, dtype, device),
                "down_proj": _linear(c.intermediate_size, c.hidden_size, dtype, device),
            }
        )

    def forward(
        self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        h = self.norm2(x)
        mlp = self.mlp
        gated = vision_activation(self.act, mlp["gate_proj"](h)) * mlp["up_proj"](h)
        return x + mlp["down_proj"](gated)


class PatchMerger(nn.Module):
    """merge_size^2 neighbouring patches -> one row of the language model's width."""

    def __init__(self, c: QwenVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(c.hidden_size, dtype, device)
        self.mlp = nn.ModuleList(
            [
                _linear(self.width, self.width, dtype, device),
                nn.GELU(),
                _linear(self.width, c.out_hidden_size, dtype, device),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            h = layer(h)
        return h


class QwenVisionTower(nn.Module):
    """See the module docstring. Checkpoint names: patch_embed.proj, blocks.N.*, merger.*."""

    def __init__(self, c: QwenVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = nn.ModuleDict(
            {"proj": _linear(c.patch_width, c.hidden_size, dtype, device, bias=False)}
        )
        self.blocks = nn.ModuleList(VisionBlock(c, dtype, device) for _ in range(c.depth))
        self.merger = PatchMerger(c, dtype, device)
        head_dim = c.hidden_size // c.num_heads
        spatial = head_dim // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        self.inv_freq = (1.0 / c.rope_theta**exponents).to(device)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Rows [sum of t*h*w / merge^2, out_hidden] of the images' patches, in order."""
        unit = self.config.spatial_merge_size**2
        window_index, cu_window = window_layout(grids, self.config)
        order = window_index.to(patches.device)
        x = self.patch_embed["proj"](patches.to(self.merger.ln_q.weight.dtype))
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        rope = self._rope(grids, order, unit)
        cu_full = _frame_seqlens(grids)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in self.config.fullatt_block_indexes else cu_window, rope)
        merged = self.merger(x)
        return merged[torch.argsort(order)]

    def _rope(
        self, grids: Sequence[Grid], order: torch.Tensor, unit: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, head_dim] of every patch (height then width frequencies), in
        window order."""
        positions = patch_positions(grids, self.config.spatial_merge_size).to(order.device)
        freqs = positions[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        freqs = freqs.flatten(1)
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].flatten(0, 1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """(row, column) [n, 2] of every patch, merge blocks contiguous (the processor's order)."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_layout(grids: Sequence[Grid], c: QwenVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merge units in window order, and the windows' patch boundaries (cu_seqlens)."""
    m = c.spatial_merge_size
    side = c.window_size // m // c.patch_size  # a window's side in merge units
    unit = m * m
    index: list[torch.Tensor] = []
    cu = [0]
    base = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        grid = torch.arange(t * gh * gw).view(t, gh, gw)
        pad_h, pad_w = -gh % side, -gw % side
        padded = F.pad(grid, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for window in windows:
            kept = window[window >= 0]
            if len(kept):
                index.append(kept + base)
                cu.append(cu[-1] + len(kept) * unit)
        base += t * gh * gw
    return torch.cat(index), cu


def _frame_seqlens(grids: Sequence[Grid]) -> list[int]:
    """Boundaries of full attention: each frame (t) of each image attends to itself."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu
