"""The gated DeltaNet layer against transformers' Qwen3NextGatedDeltaNet (float32, same weights):
a whole prompt, the same prompt in uneven chunks across steps and token by token (its state
kept in its slot), two requests in one flattened step, a decode batch, and two TP ranks' shards
(their out_proj partial sums added) equal to one rank."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.fixtures.checkpoints import randomize
from worker_svc.distributed import ParallelState
from worker_svc.layers.gated_deltanet import CHECKPOINT_TENSORS, DeltaNetShape, GatedDeltaNet
from worker_svc.layers.state_cache import StateMetadata
from worker_svc.layers.tensor_source import InMemoryTensor

CPU = torch.device("cpu")
TOLERANCE = 1e-5
NUM_SLOTS = 4
SHAPE = DeltaNetShape(
    hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, conv_kernel=4,
    eps=1e-6,
)  # fmt: skip


@dataclass
class Ctx:
    state: StateMetadata


class SummedParallel(ParallelState):
    """A TP rank whose all-reduce returns its own partial sum (the test adds the ranks')."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=SHAPE.hidden_size,
        linear_num_key_heads=SHAPE.num_k_heads,
        linear_num_value_heads=SHAPE.num_v_heads,
        linear_key_head_dim=SHAPE.head_k_dim,
        linear_value_head_dim=SHAPE.head_v_dim,
        linear_conv_kernel_dim=SHAPE.conv_kernel,
        rms_norm_eps=SHAPE.eps,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    module = Qwen3NextGatedDeltaNet(config, 0)
    randomize(module, seed=3, std=0.1)
    return module.eval()


def build(reference: torch.nn.Module, parallel: ParallelState | None = None) -> GatedDeltaNet:
    layer = GatedDeltaNet(
        SHAPE, parallel=parallel or ParallelState(), dtype=torch.float32, device=CPU
    )
    for name, tensor in reference.state_dict().items():
        module, param, part = CHECKPOINT_TENSORS[name]
        target = layer.get_submodule(module) if module else layer
        target.load(param, InMemoryTensor(tensor.detach()), part)  # type: ignore[operator]
    return layer


def new_cache(layer: GatedDeltaNet) -> tuple[torch.Tensor, ...]:
    spec = layer.state_spec()
    # slots hold garbage until a request's first chunk: a fresh request must not read it
    return tuple(torch.randn(NUM_SLOTS, *shape, dtype=spec.dtype) for shape in spec.shapes)


def step(
    layer: GatedDeltaNet,
    cache: tuple[torch.Tensor, ...],
    runs: list[tuple[torch.Tensor, int, int]],
) -> list[torch.Tensor]:
    """One flattened step: runs of (hidden rows, tokens computed before, slot); their outputs."""
    starts = [0]
    for rows, _, _ in runs:
        starts.append(starts[-1] + rows.shape[0])
    meta = StateMetadata.of(starts, [r[1] for r in runs], [r[2] for r in runs], CPU)
    with torch.no_grad():
        out = layer(torch.cat([r[0] for r in runs]), Ctx(meta), cache)
    return [out[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def run_in_chunks(
    layer: GatedDeltaNet, cache: tuple[torch.Tensor, ...], hidden: torch.Tensor,
    sizes: list[int], slot: int,
) -> torch.Tensor:  # fmt: skip
    outs, done = [], 0
    for size in sizes:
        outs += step(layer, cache, [(hidden[done : done + size], done, slot)])
        done += size
    assert done == hidden.shape[0]
    return torch.cat(outs)


def expected(reference: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(hidden.unsqueeze(0))[0]


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, SHAPE.hidden_size, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize(
    "sizes",
    [[150], [70, 1, 33, 46], [3, 1, 1, 64, 81], [1] * 20 + [130]],
    ids=["whole", "uneven", "small-first", "token-by-token-then-prefill"],
)
def test_chunks_equal_whole_prompt(reference: torch.nn.Module, sizes: list[int]) -> None:
    layer = build(reference)
    hidden = prompt(150, seed=1)
    out = run_in_chunks(layer, new_cache(layer), hidden, sizes, slot=2)
    assert max_diff(out, expected(reference, hidden)) < TOLERANCE


def test_token_by_token(reference: torch.nn.Module) -> None:
    layer = build(reference)
    hidden = prompt(40, seed=2)
    out = run_in_chunks(layer, new_cache(layer), hidden, [1] * 40, slot=1)
    assert max_diff(out, expected(reference, hidden)) < TOLERANCE


def test_two_requests_in_one_step(reference: torch.nn.Module) -> None:
    """A prefill continuing from its slot beside a fresh one, then both decoding together."""
    layer = build(reference)
    cache = new_cache(layer)
    first, second = prompt(90, seed=4), prompt(71, seed=5)
    head = step(layer, cache, [(first[:20], 0, 3)])[0]
    mid = step(layer, cache, [(first[20:88], 20, 3), (second[:70], 0, 1)])
    tail = step(layer, cache, [(first[88:89], 88, 3), (second[70:71], 70, 1)])
    last = step(layer, cache, [(first[89:90], 89, 3)])[0]
    out_first = torch.cat([head, mid[0], tail[0], last])
    out_second = torch.cat([mid[1], tail[1]])
    assert max_diff(out_first, expected(reference, first)) < TOLERANCE
    assert max_diff(out_second, expected(reference, second)) < TOLERANCE


def test_decode_batch_with_a_fresh_request(reference: torch.nn.Module) -> None:
    """Three decode rows in one step, one of them a one-token prompt (a zero state)."""
    layer = build(reference)
    cache = new_cache(layer)
    prompts = [prompt(66, seed=6), prompt(9, seed=7), prompt(1, seed=8)]
    slots = [2, 3, 1]
    for hidden, slot in zip(prompts[:2], slots, strict=False):
        step(layer, cache, [(hidden[:-1], 0, slot)])
    runs = [(h[-1:], h.shape[0] - 1, s) for h, s in zip(prompts, slots, strict=True)]
    outs = step(layer, cache, runs)
    for hidden, out in zip(prompts, outs, strict=True):
        assert max_diff(out, expected(reference, hidden)[-1:]) < TOLERANCE


def test_two_tp_ranks_sum_to_one(reference: torch.nn.Module) -> None:
    """Each rank holds whole key-head groups: the ranks' out_proj partials add up to TP=1."""
    ranks = [build(reference, SummedParallel(rank=r, tp_size=2)) for r in range(2)]
    hidden = prompt(80, seed=9)
    total = sum(run_in_chunks(rank, new_cache(rank), hidden, [67, 1, 12], slot=1) for rank in ranks)
    assert isinstance(total, torch.Tensor)
    assert max_diff(total, expected(reference, hidden)) < TOLERANCE
    spec = ranks[0].state_spec()
    assert spec.shapes == ((2 * 8 + 2 * 16, 3), (2, 8, 16))  # one key head, two value heads


def test_heads_not_divisible_by_tp(reference: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 4"):
        GatedDeltaNet(
            SHAPE, parallel=ParallelState(rank=0, tp_size=4), dtype=torch.float32, device=CPU
        )
