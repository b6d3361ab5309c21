"""DeepSeek's expert routing, as transformers' DeepseekV2/V3 routers compute it (see
models/deepseek_v2.py): V2's softmax with greedy or group-limited top-k, V3's sigmoid with the
score-correction bias and group-limited top-k (`noaux_tc`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

import torch


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a token's experts and their weights are chosen."""

    top_k: int
    scoring: Literal["softmax", "sigmoid"]
    group_limited: bool
    num_groups: int
    topk_groups: int
    normalize: bool
    scaling: float

    @classmethod
    def read(cls, hf: Any) -> Self:
        """V2 (softmax; `topk_method` greedy or group_limited_greedy; transformers' V2 never
        normalises) or V3 (sigmoid, group-limited, `norm_topk_prob`)."""
        is_v3 = type(hf).__name__ == "DeepseekV3Config"
        method = str(getattr(hf, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy"))
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {method!r} is not supported")
        if not is_v3 and getattr(hf, "norm_topk_prob", False):
            raise ValueError(
                "norm_topk_prob for DeepSeek-V2 is not supported (transformers' V2 ignores it)"
            )
        group_limited = method != "greedy"
        return cls(
            top_k=int(hf.num_experts_per_tok),
            scoring="sigmoid" if is_v3 else "softmax",
            group_limited=group_limited,
            num_groups=int(hf.n_group or 1) if group_limited else 1,
            topk_groups=int(hf.topk_group or 1) if group_limited else 1,
            normalize=is_v3 and bool(hf.norm_topk_prob),
            scaling=float(hf.routed_scaling_factor or 1.0),
        )


def route_deepseek(
    logits: torch.Tensor, bias: torch.Tensor | None, routing: RoutingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, top_k] from float32 router logits [T, E]."""
    if routing.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        choice = scores if not routing.group_limited else _keep_groups(scores, scores, routing, 0.0)
        weights, ids = torch.topk(choice, routing.top_k, dim=-1, sorted=False)
    else:
        scores = logits.sigmoid()
        biased = scores if bias is None else scores + bias
        choice = _keep_groups(biased, biased, routing, float("-inf"))
        ids = torch.topk(choice, routing.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


def _keep_groups(
    scores: torch.Tensor, ranked: torch.Tensor, routing: RoutingConfig, fill: float
) -> torch.Tensor:
    """`scores` outside the `topk_groups` best groups set to `fill`; groups ranked by their
    best score (softmax) or the sum of their two best (sigmoid), of `ranked`."""
    tokens, num_experts = scores.shape
    grouped = ranked.view(tokens, routing.num_groups, num_experts // routing.num_groups)
    if routing.scoring == "softmax":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, routing.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    return scores.masked_fill(~keep, fill)
