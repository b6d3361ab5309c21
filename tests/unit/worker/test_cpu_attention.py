"""The cpu attention backend against the torch backend (the reference) on serving-sized steps:
prompts longer than one query block, a chunk continuing cached context, decodes in between."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.attention import cpu_backend
from worker_svc.attention.backend import AttentionBackend, AttentionInputs
from worker_svc.attention.cpu_backend import QUERY_BLOCK
from worker_svc.attention.kv_quant import KvScales
from worker_svc.attention.selector import backend_class
from worker_svc.kernels.cpu_kernels import CpuKernels, using_cpu_kernels
from worker_svc.runner.kv_cache import KvCacheSpec, PagedKVCache

H, KVH, D, BLOCK_SIZE = 12, 4, 32, 16
CPU = torch.device("cpu")
# request -> (tokens cached by step 1, tokens after step 2)
SPANS = {0: (0, 2 * QUERY_BLOCK + 37), 1: (40, 41), 2: (150, 150 + QUERY_BLOCK + 9), 3: (7, 8)}
K_SCALES = KvScales(k_scale=0.5, v_scale=1.5)


def two_steps(
    name: str,
    dtype: torch.dtype,
    then_decode: bool = False,
    native: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Step 1 caches each request's context, step 2 runs SPANS; returns step 2's output, or
    with `then_decode` that of a step 3 where every request decodes one more token. `native`:
    the cpu backend's decodes run through the CPU kernel. `kv_dtype`: an fp8 cache, with the
    scales K_SCALES."""
    gen = torch.Generator().manual_seed(0)
    kernels = CpuKernels.load() if native else None
    assert kernels is not None or not native
    with using_cpu_kernels(kernels):
        backend: AttentionBackend = backend_class(name)(
            H, KVH, D, dtype=dtype, device=CPU, kv_cache_dtype=kv_dtype
        )
    if kv_dtype is not None:
        backend = backend.with_kv_scales(K_SCALES)
    spec = KvCacheSpec(num_layers=1, num_kv_heads=KVH, head_dim=D, dtype=backend.kv_cache_dtype)
    cache = PagedKVCache(backend, spec, num_blocks=128, block_size=BLOCK_SIZE, device=CPU)
    cache.zero_blocks(np.arange(128))
    perm = (torch.randperm(127, generator=gen) + 1).tolist()
    tables = {
        r: [perm.pop() for _ in range(-(-(end + 1) // BLOCK_SIZE))] for r, (_, end) in SPANS.items()
    }
    qkv = {
        r: [torch.randn(end + 1, h, D, generator=gen).to(dtype) for h in (H, KVH, KVH)]
        for r, (_, end) in SPANS.items()
    }

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        reqs = list(spans)
        width = max(len(t) for t in tables.values())
        block_tables = np.zeros((len(reqs), width), np.int64)
        slots = []
        for i, r in enumerate(reqs):
            block_tables[i, : len(tables[r])] = tables[r]
            pos = np.arange(*spans[r])
            slots.append(np.asarray(tables[r])[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        lens = [spans[r][1] - spans[r][0] for r in reqs]
        inputs = AttentionInputs(
            query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            seq_lens=np.asarray([spans[r][1] for r in reqs], np.int64),
            block_tables=block_tables,
            slot_mapping=np.concatenate(slots).astype(np.int64),
            block_size=BLOCK_SIZE,
            null_block_id=0,
        )
        q, k, v = (torch.cat([qkv[r][j][slice(*spans[r])] for r in reqs]) for j in range(3))
        return backend.forward(q, k, v, cache.layers[0], backend.build_metadata(inputs))

    run({r: (0, start) for r, (start, _) in SPANS.items() if start})
    second = run(SPANS)
    return run({r: (end, end + 1) for r, (_, end) in SPANS.items()}) if then_decode else second


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_backend_matches_torch_backend(dtype: torch.dtype, tolerance: float) -> None:
    fast, reference = two_steps("cpu", dtype), two_steps("torch", dtype)
    assert fast.shape == (sum(end - start for start, end in SPANS.values()), H, D)
    assert fast.dtype == dtype
    assert float((fast.float() - reference.float()).abs().max()) < tolerance


def test_cpu_decodes_in_groups_match_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request per decode group (the scratch reused by each, and grown when step 3's
    longer contexts need more) gives the reference's decodes, mixed and decode-only."""
    monkeypatch.setattr(cpu_backend, "DECODE_GROUP_BYTES", 1)
    for then_decode in (False, True):
        fast = two_steps("cpu", torch.float32, then_decode)
        reference = two_steps("torch", torch.float32, then_decode)
        assert fast.shape == reference.shape
        assert float((fast - reference).abs().max()) < 1e-5


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decodes_match_torch_backend(dtype: torch.dtype, tolerance: float) -> None:
    """The CPU kernel's decodes (read in place through the block tables), in a step mixed with
    prefill chunks and in a decode-only step, give the reference's output."""
    for then_decode in (False, True):
        fast = two_steps("cpu", dtype, then_decode, native=True)
        reference = two_steps("torch", dtype, then_decode)
        assert fast.shape == reference.shape and fast.dtype == dtype
        assert float((fast.float() - reference.float()).abs().max()) < tolerance


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_cache_cpu_paths_match_torch_backend(
    kv_dtype: torch.dtype, dtype: torch.dtype, tolerance: float
) -> None:
    """With an fp8 cache (scaled), the cpu backend's gathered and native decodes and its
    blocked prefills read the same dequantized values as the torch reference: the bounds are
    the compute dtype's, as for a cache in that dtype."""
    for then_decode in (False, True):
        reference = two_steps("torch", dtype, then_decode, kv_dtype=kv_dtype)
        for native in (False, True):
            fast = two_steps("cpu", dtype, then_decode, native, kv_dtype=kv_dtype)
            assert fast.shape == reference.shape and fast.dtype == dtype
            assert float((fast.float() - reference.float()).abs().max()) < tolerance


@pytest.mark.parametrize(
    ("kv_dtype", "step"), [(torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)]
)
def test_fp8_cache_stays_within_its_precision(kv_dtype: torch.dtype, step: float) -> None:
    """Against the float32 cache, the fp8 one moves the attention output (unit-normal keys and
    values, the largest about 4) by less than one value's worst rounding (`step`: 2^-4 of it
    for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2) at the largest, and by a quarter `step` on
    average (measured: e4m3 0.09 / 0.006, e5m2 0.27 / 0.012); wrong scales or bytes would
    move it by about the values themselves (~1)."""
    for then_decode in (False, True):
        exact = two_steps("torch", torch.float32, then_decode)
        fp8 = two_steps("cpu", torch.float32, then_decode, native=True, kv_dtype=kv_dtype)
        error = (fp8 - exact).abs()
        assert 0 < float(error.max()) < 4 * step
        assert float(error.mean()) < step / 4
