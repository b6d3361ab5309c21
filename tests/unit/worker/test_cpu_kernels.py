"""The CPU kernels (worker_svc/kernels/cpu_ops.cpp) against the torch path they replace: bf16
bit for bit where the torch path rounds the same way, float32 and float16 within rounding; bad inputs
refused with a message; the worker falls back to the torch path where they cannot be built."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker_svc.kernels.cpu_kernels import DISABLE_ENV, CpuKernels, using_cpu_kernels
from worker_svc.layers.activation import SiluAndMul, silu_and_mul
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rope_config import RopeConfig
from worker_svc.layers.rotary import RotaryEmbedding

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = CpuKernels.load()
    assert loaded is not None, "the CPU kernels did not build (is g++ installed?)"
    return loaded


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16: identical bits (the rounding hides the float32 sums' order); float16: within one
    of its finer ulps; float32: within a few ulps."""
    if a.dtype == torch.bfloat16:
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    elif a.dtype == torch.float16:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(kernels: CpuKernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(768, 1e-5, dtype=dtype, device=CPU)
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    x, residual = (torch.randn(37, 768, generator=gen).to(dtype) for _ in range(2))
    close(kernels.rms_norm(x, norm.weight, 1e-5), norm(x))
    expected, expected_residual = norm.add_and_norm(x, residual.clone())
    native_residual = residual.clone()
    close(kernels.fused_add_rms_norm(x, native_residual, norm.weight, 1e-5), expected)
    close(native_residual, expected_residual)
    with using_cpu_kernels(kernels):  # the layer takes the kernel for 2-D rows, torch for the rest
        fused = RMSNorm(768, 1e-5, dtype=dtype, device=CPU)
        small = RMSNorm(64, 1e-5, dtype=dtype, device=CPU)
    assert fused.implementation == "cpu_kernels" and norm.implementation == "native"
    fused.weight.data.copy_(norm.weight)
    close(fused.add_and_norm(x, residual.clone())[0], expected)
    heads = x.view(37, 12, 64)
    close(small(heads), RMSNorm(64, 1e-5, dtype=dtype, device=CPU)(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels: CpuKernels, dtype: torch.dtype) -> None:
    gate_up = (torch.randn(19, 2 * 1000, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    close(kernels.silu_and_mul(gate_up), silu_and_mul(gate_up.clone()))
    with using_cpu_kernels(kernels):
        op = SiluAndMul()
    assert op.implementation == "cpu_kernels" and SiluAndMul().implementation == "native"
    close(op(gate_up.clone()), silu_and_mul(gate_up.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_in_place_on_the_fused_qkv(
    kernels: CpuKernels, dtype: torch.dtype, partial: float
) -> None:
    h, kvh, d = 12, 4, 64
    rope = RopeConfig(partial_rotary_factor=partial)
    rotary = RotaryEmbedding(d, 4096, rope, dtype=dtype, device=CPU)
    with using_cpu_kernels(kernels):
        in_place = RotaryEmbedding(d, 4096, rope, dtype=dtype, device=CPU)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(23, h + 2 * kvh, d, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (23,), generator=gen)
    cos, sin = rotary.cos_sin(positions)
    expected = rotary(qkv[:, : h + kvh], positions, cos, sin)
    rotated = qkv.clone()
    out = in_place(rotated[:, : h + kvh], positions, cos, sin)
    assert out.data_ptr() == rotated.data_ptr()  # in place, no copy
    close(rotated[:, : h + kvh], expected)
    assert torch.equal(rotated[:, h + kvh :], qkv[:, h + kvh :])  # the values stay as they were


def test_bad_inputs_are_refused_with_a_message(kernels: CpuKernels) -> None:
    rotary = RotaryEmbedding(64, 128, RopeConfig(), dtype=torch.float32, device=CPU)
    x = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match="position 128 outside"):
        kernels.rotary_neox_(x, torch.tensor([0, 128]), rotary.cos_cache, rotary.sin_cache, 64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    cache = torch.zeros(2, 4, 2, 16, 64)
    query, out = torch.randn(1, 4, 64), torch.empty(1, 4, 64)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        kernels.paged_decode_attention(
            out, query, cache, torch.tensor([[1, 9]]), torch.tensor([20]), 0.125
        )
    with pytest.raises(RuntimeError, match="seq_len 33 does not fit"):
        kernels.paged_decode_attention(
            out, query, cache, torch.tensor([[1, 2]]), torch.tensor([33]), 0.125
        )


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """CpuKernels.load() decides again, with an empty cache folder; restored afterwards."""
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    CpuKernels.load.cache_clear()
    yield
    CpuKernels.load.cache_clear()


def test_disabled_by_the_environment(fresh_load: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert CpuKernels.load() is None


def test_a_failed_build_falls_back_to_the_torch_path(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "false")
    with caplog.at_level(logging.WARNING):
        assert CpuKernels.load() is None
    assert "CPU kernels unavailable, running the torch path" in caplog.text


def reference_decode(
    query: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float32, one request at a time, blocks gathered in order."""
    num_kv_heads, block_size, d = cache.shape[2], cache.shape[3], cache.shape[4]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = tables[i, : -(-seq_len // block_size)]
        k, v = (cache[h, blocks].transpose(0, 1).reshape(num_kv_heads, -1, d) for h in (0, 1))
        k, v = k[:, :seq_len].float(), v[:, :seq_len].float()
        q = query[i].float().view(num_kv_heads, group, d)
        probs = torch.softmax(q @ k.transpose(1, 2) * d**-0.5, dim=-1)
        out[i] = (probs @ v).reshape(-1, d)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(12, 4, 64, 16), (8, 8, 128, 8), (16, 2, 64, 32), (4, 1, 96, 16)],
)
def test_paged_decode_attention_against_float_reference(
    kernels: CpuKernels,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Contexts of 1 key to several blocks with a partial last block (odd and even lengths),
    blocks scattered over the cache, the query a strided slice of a fused qkv tensor."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, seq_lens = 64, torch.tensor([1, 2, 17, 3 * block_size, 5 * block_size - 3])
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    width = -(-int(seq_lens.max()) // block_size)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: 5 * width] + 1).view(5, width)
    qkv = torch.randn(5, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :heads]
    out = torch.empty(query.shape, dtype=dtype)
    kernels.paged_decode_attention(out, query, cache, tables, seq_lens, head_dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = (out.float() - reference_decode(query, cache, tables, seq_lens)).abs().max()
    assert float(error) < tolerance


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def random_fp8_cache(
    shape: tuple[int, ...], fp8: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Values spread over the format's normal and subnormal range, finite (saturated writes
    never store NaN or infinity)."""
    values = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-12, 4, shape, generator=gen)
    )
    limit = torch.finfo(fp8).max
    return values.clamp(-limit, limit).to(fp8)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(12, 4, 64, 16), (4, 1, 96, 5), (6, 3, 32, 7)]
)
def test_paged_decode_attention_over_fp8_cache(
    kernels: CpuKernels,
    fp8: torch.dtype,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """An fp8 cache (keys / k_scale, values / v_scale) read in place against the float
    reference over the same cache dequantized: every fp8 value is exact in bf16 and float32, so
    fp8's own precision does not enter and the bounds are the compute dtype's, relative to the
    values' size.
    Odd block sizes and head_dim 96 take the portable loop, head_dim 32/64 in bf16 the
    AVX512-BF16 one where the CPU has it."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, seq_lens = 48, torch.tensor([1, 2, 17, 3 * block_size, 5 * block_size - 3])
    cache = random_fp8_cache((2, num_blocks, kv_heads, block_size, head_dim), fp8, gen)
    width = -(-int(seq_lens.max()) // block_size)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: 5 * width] + 1).view(5, width)
    query = torch.randn(5, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty(query.shape, dtype=dtype)
    k_scale, v_scale = 0.75, 3.5
    kernels.paged_decode_attention(
        out, query, cache, tables, seq_lens, head_dim**-0.5, k_scale, v_scale
    )
    dequantized = cache.float() * torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    expected = reference_decode(query, dequantized, tables, seq_lens)
    # The output averages values of up to ~100 here: float32 sums within ~1e-6 of them, bf16
    # (probabilities and outputs rounded to 8 significant bits) within 2^-7 of them.
    largest = float(dequantized[1].abs().max())
    tolerance = largest * (1e-6 if dtype == torch.float32 else 2**-7)
    error = (out.float() - expected).abs().max()
    assert float(error) < tolerance


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_value_reads_back_exactly(
    kernels: CpuKernels, fp8: torch.dtype, dtype: torch.dtype
) -> None:
    """A one-key context's output is its value row: each of the 256 byte codes but NaN and
    infinity (never stored: writes saturate) reads back as torch's own conversion, subnormals,
    signed zeros and the largest values included, in the portable and the AVX512-BF16 loops."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(fp8).float())]
    head_dim = 64
    rows = torch.cat([codes, codes[: -len(codes) % head_dim]]).view(-1, head_dim)
    cache = torch.zeros(2, len(rows) + 1, 1, 1, head_dim, dtype=torch.uint8)
    cache[1, 1:, 0, 0] = rows
    tables = torch.arange(1, len(rows) + 1).view(-1, 1)
    query = torch.randn(len(rows), 1, head_dim).to(dtype)
    out = torch.empty(query.shape, dtype=dtype)
    seq_lens = torch.ones(len(rows), dtype=torch.long)
    kernels.paged_decode_attention(out, query, cache.view(fp8), tables, seq_lens, 0.125)
    torch.testing.assert_close(out[:, 0], rows.view(fp8).to(dtype), rtol=0, atol=0)


def test_fp8_cache_refusals(kernels: CpuKernels) -> None:
    cache = torch.zeros(2, 4, 2, 16, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    query, out = torch.randn(1, 4, 64), torch.empty(1, 4, 64)
    tables, lens = torch.tensor([[1]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="positive and finite"):
        kernels.paged_decode_attention(out, query, cache, tables, lens, 0.125, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="1 unless the cache is fp8"):
        kernels.paged_decode_attention(out, query, cache.float(), tables, lens, 0.125, 2.0, 1.0)
    with pytest.raises(RuntimeError, match="float8_e4m3fn/e5m2"):
        kernels.paged_decode_attention(out, query, cache.view(torch.int8), tables, lens, 0.125)
