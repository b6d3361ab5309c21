"""Paged attention backends against a dense causal-attention reference.

The step mixes a prefill chunk with prior context (read back from the cache), a fresh prefill
and decodes, with GQA, over several block sizes; also with a sliding window (narrower than
the chunk and than the context) and soft-capped scores (Gemma 2). The Triton kernel runs on CPU under
TRITON_INTERPRET=1 (set before triton is imported) and is skipped when triton is absent;
flash-attn's backend needs CUDA and is skipped without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

from worker_svc.attention.backend import (
    AttentionBackend,
    AttentionInputs,
    AttentionOptions,
    is_importable,
)
from worker_svc.attention.selector import backend_class, select_backend
from worker_svc.runner.kv_cache import KvCacheSpec, PagedKVCache

H, KVH, D = 6, 2, 16
CPU = torch.device("cpu")


FULL = AttentionOptions()
WINDOWED = AttentionOptions(sliding_window=5)
CAPPED = AttentionOptions(logits_soft_cap=1.5, scale=0.4)
BOTH = AttentionOptions(sliding_window=3, logits_soft_cap=2.0)


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_context: int,
    options: AttentionOptions = FULL,
) -> torch.Tensor:
    """Causal attention of q [Tq, H, D] over k/v [S, KVH, D]; query i sits at num_context + i."""
    rep = H // KVH
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = D**-0.5 if options.scale is None else options.scale
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if options.logits_soft_cap is not None:
        scores = torch.tanh(scores / options.logits_soft_cap) * options.logits_soft_cap
    q_pos = torch.arange(q.shape[0])[:, None] + num_context
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if options.sliding_window is not None:
        hidden |= k_pos <= q_pos - options.sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def run_two_steps(
    backend: AttentionBackend,
    block_size: int,
    seed: int,
    options: AttentionOptions = FULL,
) -> tuple[float, int]:
    """Step 1 caches context; step 2 mixes decodes, a continued chunk and a fresh prefill.
    Returns the largest difference from the dense reference, and the tokens checked."""
    gen = torch.Generator().manual_seed(seed)
    spec = KvCacheSpec(num_layers=1, num_kv_heads=KVH, head_dim=D, dtype=torch.float32)
    cache = PagedKVCache(backend, spec, num_blocks=64, block_size=block_size, device=CPU)
    seq_lens = {0: 23, 1: 9, 2: 31, 3: 7}  # final lengths
    context = {0: 22, 1: 8, 2: 17, 3: 0}  # cached by step 1; req 2 continues a chunk
    perm = (torch.randperm(60, generator=gen) + 1).tolist()  # block 0 is the null block
    tables = {r: [perm.pop() for _ in range(-(-n // block_size))] for r, n in seq_lens.items()}
    keys = {r: torch.randn(n, KVH, D, generator=gen) for r, n in seq_lens.items()}
    values = {r: torch.randn(n, KVH, D, generator=gen) for r, n in seq_lens.items()}
    queries = {r: torch.randn(n, H, D, generator=gen) for r, n in seq_lens.items()}

    def run(spans: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        reqs = list(spans)
        lens = [spans[r][1] - spans[r][0] for r in reqs]
        width = max(len(tables[r]) for r in reqs)
        block_tables = np.full((len(reqs), width), cache.null_block_id, np.int64)
        slots = []
        for i, r in enumerate(reqs):
            block_tables[i, : len(tables[r])] = tables[r]
            pos = np.arange(*spans[r])
            slots.append(np.asarray(tables[r])[pos // block_size] * block_size + pos % block_size)
        inputs = AttentionInputs(
            query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            seq_lens=np.asarray([spans[r][1] for r in reqs], np.int64),
            block_tables=block_tables,
            slot_mapping=np.concatenate(slots).astype(np.int64),
            block_size=block_size,
            null_block_id=cache.null_block_id,
        )
        q = torch.cat([queries[r][slice(*spans[r])] for r in reqs])
        k = torch.cat([keys[r][slice(*spans[r])] for r in reqs])
        v = torch.cat([values[r][slice(*spans[r])] for r in reqs])
        layer = backend.with_options(options)
        out = layer.forward(q, k, v, cache.layers[0], backend.build_metadata(inputs))
        return dict(zip(reqs, torch.split(out, lens), strict=True))

    run({r: (0, n) for r, n in context.items() if n})
    outs = run({r: (context[r], seq_lens[r]) for r in seq_lens})
    worst, checked = 0.0, 0
    for r, out in outs.items():
        ref = dense_reference(queries[r][context[r] :], keys[r], values[r], context[r], options)
        worst = max(worst, float((out - ref).abs().max()))
        checked += out.shape[0]
    return worst, checked


@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_matches_dense_reference(block_size: int) -> None:
    backend = backend_class("torch")(H, KVH, D, dtype=torch.float32, device=CPU)
    worst, checked = run_two_steps(backend, block_size, seed=block_size)
    assert checked == 1 + 1 + 14 + 7
    assert worst < 1e-5


@pytest.mark.parametrize("options", [WINDOWED, CAPPED, BOTH], ids=["window", "cap", "both"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_windows_and_caps_match_dense_reference(
    block_size: int, options: AttentionOptions
) -> None:
    backend = backend_class("torch")(H, KVH, D, dtype=torch.float32, device=CPU)
    worst, checked = run_two_steps(backend, block_size, block_size, options)
    assert checked == 23
    assert worst < 1e-5


@pytest.mark.skipif(not is_importable("triton"), reason="triton is not installed")
@pytest.mark.parametrize("options", [WINDOWED, CAPPED, BOTH], ids=["window", "cap", "both"])
def test_triton_kernel_windows_and_caps_match_reference(options: AttentionOptions) -> None:
    backend = backend_class("triton")(H, KVH, D, dtype=torch.float32, device=CPU)
    worst, checked = run_two_steps(backend, 4, seed=3, options=options)
    assert checked == 23
    assert worst < 1e-5


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        AttentionOptions(logits_soft_cap=-1.0)


@pytest.mark.skipif(not is_importable("triton"), reason="triton is not installed")
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_triton_kernel_matches_reference_under_interpreter(block_size: int) -> None:
    backend = backend_class("triton")(H, KVH, D, dtype=torch.float32, device=CPU)
    worst, checked = run_two_steps(backend, block_size, seed=block_size)
    assert checked == 23
    assert worst < 1e-5


@pytest.mark.skipif(
    not (is_importable("flash_attn") and torch.cuda.is_available()),
    reason="flash_attn needs its package and a CUDA device",
)
def test_flash_attn_backend_matches_reference() -> None:
    cuda = torch.device("cuda")
    backend = backend_class("flash_attn")(H, KVH, D, dtype=torch.bfloat16, device=cuda)
    worst, checked = run_two_steps(backend, 256, seed=0)
    assert checked == 23 and worst < 2e-2
    for options in (WINDOWED, CAPPED, BOTH):
        worst, _ = run_two_steps(backend, 256, seed=1, options=options)
        assert worst < 2e-2


@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_backend_matches_dense_reference(block_size: int) -> None:
    backend = backend_class("cpu")(H, KVH, D, dtype=torch.float32, device=CPU)
    worst, checked = run_two_steps(backend, block_size, seed=block_size)
    assert checked == 23
    assert worst < 1e-5


def test_selector_picks_cpu_on_cpu_and_explains_refusals() -> None:
    assert select_backend("auto", CPU) == "cpu"
    assert select_backend("torch", CPU) == "torch"
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", CPU)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("paged_magic", CPU)
    reason = backend_class("flash_attn").unsupported_reason(torch.device("cuda"), 16)
    assert reason is not None and ("256" in reason or "not installed" in reason)
