"""Mixture-of-experts pieces: routing as each model defines it, the grouped expert path against
a per-token reference, the tensor-parallel split of every expert and the expert-parallel split
of the experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.distributed import ParallelState
from worker_svc.layers import moe as moe_layer
from worker_svc.layers.moe import FusedExperts, MoeConfig, expert_range, route
from worker_svc.layers.tensor_source import InMemoryTensor

CPU = torch.device("cpu")
HIDDEN, INTER, NUM_EXPERTS, TOP_K = 32, 24, 6, 2
MOE = MoeConfig(NUM_EXPERTS, TOP_K, INTER, renormalize=True, sparse_layers=(True,))


def checkpoint_experts(seed: int) -> dict[str, torch.Tensor]:
    """Per-expert gate / up [INTER, HIDDEN] and down [HIDDEN, INTER], as checkpoints store them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(NUM_EXPERTS):
        tensors[f"{e}.gate"] = torch.randn(INTER, HIDDEN, generator=gen) * 0.2
        tensors[f"{e}.up"] = torch.randn(INTER, HIDDEN, generator=gen) * 0.2
        tensors[f"{e}.down"] = torch.randn(HIDDEN, INTER, generator=gen) * 0.2
    return tensors


def load_experts(
    tensors: dict[str, torch.Tensor], parallel: ParallelState, dtype: torch.dtype = torch.float32
) -> FusedExperts:
    experts = FusedExperts(HIDDEN, MOE, parallel=parallel, dtype=dtype, device=CPU)
    for e in range(NUM_EXPERTS):
        experts.load("w13_weight", InMemoryTensor(tensors[f"{e}.gate"]), 2 * e)
        experts.load("w13_weight", InMemoryTensor(tensors[f"{e}.up"]), 2 * e + 1)
        experts.load("w2_weight", InMemoryTensor(tensors[f"{e}.down"]), e)
    return experts


def per_token_reference(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            row = x[t].double()
            hidden = F.silu(tensors[f"{e}.gate"].double() @ row) * (
                tensors[f"{e}.up"].double() @ row
            )
            out[t] += weights[t, k].double() * (tensors[f"{e}.down"].double() @ hidden)
    return out.float()


def routed_inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    logits[:, 5] = -30.0  # expert 5 gets no token: an empty group
    weights, ids = route(logits, TOP_K, renormalize=True)
    return x, weights, ids


def test_mixtral_routing_is_a_softmax_over_the_top_k_logits() -> None:
    logits = torch.randn(7, NUM_EXPERTS)
    weights, ids = route(logits, TOP_K, renormalize=True)
    top_logits, top_ids = logits.topk(TOP_K, dim=-1)
    assert torch.equal(ids, top_ids)
    assert torch.allclose(weights, top_logits.softmax(-1), atol=1e-6)


def test_qwen3_moe_routing_without_norm_topk_prob_keeps_the_probabilities() -> None:
    logits = torch.randn(7, NUM_EXPERTS)
    weights, ids = route(logits, TOP_K, renormalize=False)
    assert torch.allclose(weights, logits.softmax(-1).gather(1, ids), atol=1e-7)
    assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("is_grouped", [True, False], ids=["grouped_mm", "per_expert"])
def test_grouped_experts_match_the_per_token_reference(
    is_grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not is_grouped:
        monkeypatch.setattr(moe_layer, "can_group", lambda rows, weight: False)
    tensors = checkpoint_experts(0)
    experts = load_experts(tensors, ParallelState(), torch.bfloat16)
    x, weights, ids = routed_inputs(num_tokens=19)
    assert moe_layer.can_group(x.bfloat16(), experts.w13_weight) == is_grouped
    out = experts(x.bfloat16(), weights, ids).float()
    assert (ids != 5).all()
    rounded = {name: t.bfloat16().float() for name, t in tensors.items()}
    reference = per_token_reference(x.bfloat16().float(), rounded, weights, ids)
    assert float((out - reference).abs().max()) < 0.03  # bfloat16 rounding
    assert float((out - reference).norm() / reference.norm()) < 0.01


def test_float32_experts_match_the_per_token_reference() -> None:
    tensors = checkpoint_experts(0)
    experts = load_experts(tensors, ParallelState())
    x, weights, ids = routed_inputs(num_tokens=19)
    out = experts(x, weights, ids)
    assert float((out - per_token_reference(x, tensors, weights, ids)).abs().max()) < 1e-5


def test_tensor_parallel_ranks_each_hold_half_of_every_expert() -> None:
    """Rank r holds rows [r * 12, (r + 1) * 12) of each gate / up and those columns of each
    down projection; the two partial outputs sum (the all-reduce) to the whole."""
    tensors = checkpoint_experts(1)
    whole = load_experts(tensors, ParallelState())
    halves = [load_experts(tensors, ParallelState(rank=r, tp_size=2)) for r in range(2)]
    assert halves[1].w13_weight.shape == (NUM_EXPERTS, INTER, HIDDEN)
    assert torch.equal(halves[1].w13_weight[3, :12], tensors["3.gate"][12:])
    assert torch.equal(halves[1].w13_weight[3, 12:], tensors["3.up"][12:])
    assert torch.equal(halves[0].w2_weight[4], tensors["4.down"][:, :12])
    x, weights, ids = routed_inputs(num_tokens=9)
    summed = halves[0](x, weights, ids) + halves[1](x, weights, ids)
    assert torch.allclose(summed, whole(x, weights, ids), atol=1e-5)


def test_an_expert_size_that_tp_cannot_split_is_refused() -> None:
    with pytest.raises(ValueError, match="expert intermediate size"):
        FusedExperts(
            HIDDEN, MOE, parallel=ParallelState(tp_size=5), dtype=torch.float32, device=CPU
        )


def test_expert_parallel_ranks_each_hold_whole_experts() -> None:
    """6 experts over 4 ranks: 2, 2, 1, 1 whole experts; each rank runs only the pairs routed
    to its experts, and the partial outputs sum (the all-reduce) to the whole."""
    tensors = checkpoint_experts(2)
    whole = load_experts(tensors, ParallelState())
    ranks = [
        load_experts(tensors, ParallelState(rank=r, tp_size=4, enable_expert_parallel=True))
        for r in range(4)
    ]
    assert [(r.expert_start, r.num_local_experts) for r in ranks] == [
        (0, 2),
        (2, 2),
        (4, 1),
        (5, 1),
    ]
    assert ranks[1].w13_weight.shape == (2, 2 * INTER, HIDDEN)
    assert torch.equal(ranks[1].w13_weight[1, :INTER], tensors["3.gate"])
    assert torch.equal(ranks[1].w13_weight[1, INTER:], tensors["3.up"])
    assert torch.equal(ranks[2].w2_weight[0], tensors["4.down"])
    x, weights, ids = routed_inputs(num_tokens=9)
    partials = [rank(x, weights, ids) for rank in ranks]
    assert float(partials[3].abs().max()) == 0.0  # expert 5 got no token
    summed = torch.stack(partials).sum(0)
    assert torch.allclose(summed, whole(x, weights, ids), atol=1e-5)
    reference = per_token_reference(x, tensors, weights, ids)
    assert float((summed - reference).abs().max()) < 1e-5


def test_expert_placement_is_contiguous_and_covers_every_expert() -> None:
    for num_experts, ep_size in [(8, 2), (7, 3), (5, 5), (64, 6)]:
        ranges = [expert_range(num_experts, ep_size, r) for r in range(ep_size)]
        assert ranges[0][0] == 0
        for (start, count), (next_start, _) in zip(ranges, ranges[1:], strict=False):
            assert start + count == next_start
        assert sum(count for _, count in ranges) == num_experts
        assert max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


def test_expert_parallelism_with_more_ranks_than_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one expert per rank"):
        FusedExperts(
            HIDDEN,
            MOE,
            parallel=ParallelState(tp_size=8, enable_expert_parallel=True),
            dtype=torch.float32,
            device=CPU,
        )
