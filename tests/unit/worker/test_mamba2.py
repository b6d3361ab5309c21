"""The Mamba2 mixer (layers/mamba2.py) against transformers' GraniteMoeHybridMambaLayer with the
same weights, float32: the whole prompt, the prompt cut into uneven chunks across steps
(straddling the SSD chunk of 8), token by token, several requests in one flattened step, a
decode batch, and the tensor-parallel split over two ranks (simulated in threads that sum their
all-reduces)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from tests.fixtures.checkpoints import randomize
from tests.fixtures.hybrid_checkpoints import hybrid_config, randomize_mamba
from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import UNQUANTIZED
from worker_svc.layers.mamba2 import Mamba2Config, Mamba2Mixer, mixer_targets
from worker_svc.layers.state_cache import StateMetadata
from worker_svc.layers.tensor_source import InMemoryTensor, row_range
from worker_svc.models.granitemoehybrid import read_mamba2_config

CPU = torch.device("cpu")
TOLERANCE = 1e-5
NUM_SLOTS = 6
VARIANTS = ["granite_hybrid", "granite_hybrid_g1"]  # n_groups 2; n_groups 1 with biases


def reference_layer(variant: str) -> torch.nn.Module:
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
    )

    hf = hybrid_config(variant)
    layer = GraniteMoeHybridMambaLayer(hf, layer_idx=0)
    randomize(layer, seed=7)
    randomize_mamba(layer, seed=7)
    return layer.eval()


def load_mixer(
    reference: torch.nn.Module, config: Mamba2Config, parallel: ParallelState
) -> Mamba2Mixer:
    args = {"parallel": parallel, "dtype": torch.float32, "device": CPU}
    mixer = Mamba2Mixer(config, {**args, "methods": UNQUANTIZED, "prefix": "mamba"})  # type: ignore[typeddict-item]
    for name, tensor in reference.state_dict().items():
        for module, param, part, rows in mixer_targets(config, name):
            source = InMemoryTensor(tensor)
            view = source if rows is None else row_range(source, *rows)
            mixer.get_submodule(module).load(param, view, part)  # type: ignore[operator]
    return mixer


@dataclass
class Caches:
    """One mixer's state caches, slots filled with garbage (a fresh request must not read it)."""

    mixer: Mamba2Mixer
    tensors: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        spec = self.mixer.state_spec()
        self.tensors = tuple(
            torch.randn(NUM_SLOTS, *shape, generator=gen, dtype=spec.dtype) for shape in spec.shapes
        )

    def step(self, runs: Sequence[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """One flattened step of runs (hidden [L, H], slot, tokens computed before) -> outputs."""
        starts = [0]
        for hidden, _, _ in runs:
            starts.append(starts[-1] + hidden.shape[0])
        state = StateMetadata.of(starts, [c for _, _, c in runs], [s for _, s, _ in runs], CPU)
        with torch.no_grad():
            out = self.mixer(torch.cat([h for h, _, _ in runs]), state, self.tensors)
        return [out[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def run_in_chunks(
    caches: Caches, hidden: torch.Tensor, sizes: Sequence[int], slot: int
) -> torch.Tensor:
    outs: list[torch.Tensor] = []
    done = 0
    for size in sizes:
        outs += caches.step([(hidden[done : done + size], slot, done)])
        done += size
    assert done == hidden.shape[0]
    return torch.cat(outs)


def expected(reference: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(hidden[None])[0]


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, 64, generator=torch.Generator().manual_seed(seed))


def single_rank(variant: str) -> tuple[torch.nn.Module, Caches]:
    reference = reference_layer(variant)
    config = read_mamba2_config(hybrid_config(variant))
    return reference, Caches(load_mixer(reference, config, ParallelState()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "sizes",
    [[21], [5, 9, 1, 6], [3, 13, 2, 3], [1] * 21],
    ids=["whole", "chunks", "chunks2", "token_by_token"],
)
def test_matches_transformers(variant: str, sizes: list[int]) -> None:
    reference, caches = single_rank(variant)
    hidden = prompt(21, seed=1)
    out = run_in_chunks(caches, hidden, sizes, slot=2)
    assert (out - expected(reference, hidden)).abs().max() < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_step_and_decode_batch(variant: str) -> None:
    """A continuing prefill, a decode, a fresh prompt in one step; then all three decode."""
    reference, caches = single_rank(variant)
    prompts = [prompt(14, seed=2), prompt(6, seed=3), prompt(10, seed=4)]
    slots = [3, 1, 5]
    outs: list[list[torch.Tensor]] = [[], [], []]
    outs[0] += caches.step([(prompts[0][:11], slots[0], 0)])
    outs[1] += caches.step([(prompts[1][:4], slots[1], 0)])
    mixed = [(prompts[0][11:13], slots[0], 11), (prompts[1][4:5], slots[1], 4)]
    mixed.append((prompts[2][:9], slots[2], 0))
    for i, out in enumerate(caches.step(mixed)):
        outs[i].append(out)
    decode = [(prompts[0][13:], slots[0], 13), (prompts[1][5:], slots[1], 5)]
    decode.append((prompts[2][9:], slots[2], 9))
    for i, out in enumerate(caches.step(decode)):
        outs[i].append(out)
    for hidden, runs in zip(prompts, outs, strict=True):
        assert (torch.cat(runs) - expected(reference, hidden)).abs().max() < TOLERANCE


@dataclass(slots=True)
class ThreadRank(ParallelState):
    """A TP rank whose all-reduce sums the other thread ranks' tensors (a simulated group)."""

    peers: list[torch.Tensor | None] = field(default_factory=list)
    barrier: threading.Barrier | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.barrier is not None
        self.peers[self.tp_rank] = tensor.clone()
        self.barrier.wait()
        total = torch.stack([t for t in self.peers if t is not None]).sum(0)
        self.barrier.wait()
        return tensor.copy_(total)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks(variant: str) -> None:
    """Heads split over two ranks (B and C split by group, or replicated with one group and the
    gated norm's squares all-reduced): each rank's output is the whole layer's."""
    reference = reference_layer(variant)
    config = read_mamba2_config(hybrid_config(variant))
    peers: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2)
    hidden = prompt(21, seed=5)
    outs: list[torch.Tensor | None] = [None, None]

    def run(rank: int) -> None:
        parallel = ThreadRank(rank=rank, tp_size=2, peers=peers, barrier=barrier)
        caches = Caches(load_mixer(reference, config, parallel))
        outs[rank] = run_in_chunks(caches, hidden, [7, 1, 9, 1, 3], slot=4)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    want = expected(reference, hidden)
    for out in outs:
        assert out is not None and (out - want).abs().max() < TOLERANCE


def test_refuses_groups_the_ranks_cannot_split() -> None:
    config = Mamba2Config(64, 6, 16, 16, 3, 4, 8, 1e-5)
    args = {"parallel": ParallelState(rank=0, tp_size=2), "dtype": torch.float32, "device": CPU}
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2Mixer(config, {**args, "methods": UNQUANTIZED, "prefix": "mamba"})  # type: ignore[typeddict-item]
