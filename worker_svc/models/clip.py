"""The CLIP vision transformer (LLaVA's vision tower) from plain torch modules, run replicated
on every tensor-parallel rank of the first pipeline stage (it is small next to the language
model, and replicas need no collective). Module paths match the checkpoint's tensor names
under `vision_tower.` (transformers' CLIPVisionTransformer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.models.vision_config import SUPPORTED_VISION_ACTIVATIONS, ClipVisionConfig


def vision_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ACT2FN for the activations CLIP and LLaVA projectors use."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh")
    raise ValueError(
        f"vision activation {name!r} is not supported; supported: "
        + ", ".join(SUPPORTED_VISION_ACTIVATIONS)
    )


class ClipVisionEmbeddings(nn.Module):
    """Patch embedding (a strided convolution), a learned CLS row, learned positions."""

    def __init__(self, cfg: ClipVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, d, cfg.patch_size, cfg.patch_size, bias=False, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype, device=device))
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, d, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over the patches of one image."""

    def __init__(self, cfg: ClipVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(d, d, dtype=dtype, device=device)
        self.k_proj = nn.Linear(d, d, dtype=dtype, device=device)
        self.v_proj = nn.Linear(d, d, dtype=dtype, device=device)
        self.out_proj = nn.Linear(d, d, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        shape = (batch, seq, self.num_heads, d // self.num_heads)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, d))


class ClipMLP(nn.Module):
    def __init__(self, cfg: ClipVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(vision_activation(self.act, self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ClipVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, d = cfg.layer_norm_eps, cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(d, eps=eps, dtype=dtype, device=device)
        self.self_attn = ClipAttention(cfg, dtype, device)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps, dtype=dtype, device=device)
        self.mlp = ClipMLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(
        self, cfg: ClipVisionConfig, num_layers: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg, dtype, device) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """The first `num_layers` layers of a CLIP vision transformer; `forward` returns the
    requested hidden states (0: the embeddings after pre_layrnorm, i: after layer i)."""

    def __init__(
        self, cfg: ClipVisionConfig, num_layers: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = ClipVisionEmbeddings(cfg, dtype, device)
        self.pre_layrnorm = nn.LayerNorm(  # sic: transformers' name
            cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, device=device
        )
        self.encoder = ClipEncoder(cfg, num_layers, dtype, device)

    def forward(self, pixel_values: torch.Tensor, indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states [images, 1 + patches, hidden] at `indices`, in that order."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: hidden}
        for i, layer in enumerate(self.encoder.layers, start=1):
            hidden = layer(hidden)
            states[i] = hidden
        return [states[i] for i in indices]
