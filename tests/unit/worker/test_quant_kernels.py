"""The quantized linear kernels (worker_svc/kernels/quant_ops.cpp) against a float64 reference
of the dequantized weight: int8/int4, per-row and group-wise scales, symmetric and with
offsets, act-order columns, odd shapes (N not a multiple of 16, K not of 64, partial groups)
and batches 1/3/17/64; W8A8 and its per-token quantization against vLLM's convention; bad
inputs refused with a message; and the portable build (no AVX-512) checked the same way in a
child process built with -march=x86-64-v3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch

from tests.fixtures.quantized import (
    assert_close_to_reference,
    random_quantized,
    reference_linear,
)
from worker_svc.kernels.cpu_kernels import MARCH_ENV, CpuKernels
from worker_svc.layers.linear import LinearBase
from worker_svc.layers.quant_pack import (
    GroupQuantized,
    dequantize_packed,
    from_signed,
    pack,
)
from worker_svc.layers.quantized import (
    DEQUANTIZE_ROWS,
    WeightOnlyLinearMethod,
    quantize_rows_reference,
    w8a8_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, columns, group size): odd rows, columns not a multiple of 64, a partial last group.
# Batches of 45 and 64 take int8's bf16 panels (PANEL_ROWS = 32 in quant_ops.cpp), 45 with a
# partial block of tokens.
SHAPES = [(17, 100, 100), (33, 96, 32), (50, 200, 64), (64, 256, 128), (7, 328, 128)]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = CpuKernels.load()
    assert loaded is not None, "the CPU kernels did not build (is g++ installed?)"
    return loaded


def run(kernels: CpuKernels, weight: GroupQuantized, x: torch.Tensor, bias=None) -> torch.Tensor:
    packed = pack(weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernels.quant_linear(out, x, packed, bias)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_offsets", [False, True])
def test_weight_only_matches_the_dequantized_reference(
    kernels: CpuKernels, bits: int, shape: tuple[int, int, int], with_offsets: bool
) -> None:
    num_rows, num_cols, group = shape
    weight = random_quantized(num_rows, num_cols, bits, group, with_offsets=with_offsets)
    gen = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        for batch in (1, 3, 17, 45, 64):
            x = torch.randn(batch, num_cols, generator=gen).to(dtype)
            bias = torch.randn(num_rows, generator=gen).to(dtype)
            assert_close_to_reference(
                run(kernels, weight, x, bias), reference_linear(x, weight, bias)
            )


@pytest.mark.parametrize("bits", [8, 4])
def test_act_order_columns_and_float32_scales(kernels: CpuKernels, bits: int) -> None:
    """g_idx groups (runs padded inside the packed weight) and scales that float16 cannot hold
    exactly (kept float32: packing never rounds)."""
    weight = random_quantized(40, 192, bits, 64, with_offsets=True, act_order=True, seed=3)
    weight = GroupQuantized(
        weight.values, weight.scales * (1 + 2**-20), weight.offsets, bits, 64, weight.g_idx
    )
    packed = pack(weight)
    assert packed.cols is not None and packed.scales.dtype == torch.float32
    # a tensor-parallel slice of act-order columns keeps every group: runs of uneven lengths
    half = weight.cols(slice(96, 192))
    for w in (weight, half):
        for dtype in DTYPES:
            x = torch.randn(5, w.shape[1]).to(dtype)
            assert_close_to_reference(run(kernels, w, x), reference_linear(x, w))


def test_packing_is_lossless() -> None:
    for bits in (8, 4):
        for order in ("pairs", "quads"):
            weight = random_quantized(33, 136, bits, 32, with_offsets=True, seed=bits)
            packed = pack(weight, int8_order=order)
            assert torch.equal(dequantize_packed(packed)[:33, :136], weight.dequantize())


def test_per_token_quantization_is_vllms(kernels: CpuKernels) -> None:
    """absmax / 127, 1 / scale in double, round half to even, clamp to [-128, 127]; a zero row
    quantizes to zeros with scale 0."""
    x = torch.randn(9, 300) * 5
    x[3] = 0.0
    x[4, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: exact ties
    x[4, 4:] = 0.25
    for dtype in DTYPES:
        values, scales = kernels.int8_quantize_rows(x.to(dtype))
        expected_values, expected_scales = quantize_rows_reference(x.to(dtype))
        assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
    assert values[4, :4].tolist() == [127, 0, 2, -2] and float(scales[3]) == 0.0


@pytest.mark.parametrize("num_cols", [100, 576, 1030])
def test_w8a8_is_exact_integer_arithmetic(kernels: CpuKernels, num_cols: int) -> None:
    """int32 sums of the int8 products, then (sum x weight scale) x token scale: the kernel and
    the float64 reference agree to float32 rounding, whatever the batch."""
    weight = random_quantized(37, num_cols, 8, num_cols, with_offsets=False, seed=num_cols)
    packed = pack(weight, int8_order="quads")
    scales = torch.zeros(packed.qweight.shape[0] * 16)
    scales[:37] = weight.scales[:, 0]
    sums = torch.zeros(packed.qweight.shape[0] * 16, dtype=torch.int32)
    sums[:37] = weight.values.sum(dim=1, dtype=torch.int32)
    for dtype in DTYPES:
        for batch in (1, 3, 17, 45, 64):
            x = (torch.randn(batch, num_cols) * 3).to(dtype)
            bias = torch.randn(37).to(dtype)
            out = torch.empty(batch, 37, dtype=dtype)
            kernels.w8a8_linear(out, x, packed, scales, sums, bias)
            expected = w8a8_reference(x, packed, scales, bias)
            assert_close_to_reference(out, expected)


def bad_call(kernels: CpuKernels, **changes: object) -> str:
    weight = from_signed(torch.randint(-8, 8, (20, 64)), torch.rand(20, 2), 4, 32)
    packed = pack(weight)
    args = {
        "out": torch.empty(2, 20),
        "x": torch.randn(2, 64),
        "qweight": packed.qweight,
        "bits": 4,
        "scales": packed.scales,
        "offsets": packed.offsets,
        "bounds": packed.bounds,
        "cols": None,
        "bias": None,
    }
    args.update(changes)
    with pytest.raises(RuntimeError) as err:
        kernels.ops.quant_linear(*args.values())
    return str(err.value).splitlines()[0]


def test_bad_inputs_are_refused_with_a_message(kernels: CpuKernels) -> None:
    assert "bits must be 4 or 8" in bad_call(kernels, bits=3)
    assert "take float32, bfloat16 or float16" in bad_call(
        kernels, x=torch.ones(2, 64, dtype=torch.int32), out=torch.empty(2, 20, dtype=torch.int32)
    )
    assert "x has 80 features but the weight only 64" in bad_call(kernels, x=torch.randn(2, 80))
    assert "out must be contiguous" in bad_call(kernels, out=torch.empty(2, 20).to(torch.bfloat16))
    assert "out has 40 features" in bad_call(kernels, out=torch.empty(2, 40))
    assert "scales must be contiguous" in bad_call(kernels, scales=torch.ones(2, 3, 16).half())
    assert "offsets must be shaped" in bad_call(kernels, offsets=torch.ones(2, 2, 16).half())
    assert "bounds must run from 0" in bad_call(
        kernels, bounds=torch.tensor([0, 4], dtype=torch.int32)
    )
    assert "bounds must be int32" in bad_call(kernels, bounds=torch.tensor([0, 8, 16]))
    assert "cols[1] = 99" in bad_call(kernels, cols=torch.tensor([0, 99] + [64] * 62))
    assert "qweight must be contiguous" in bad_call(
        kernels, qweight=torch.zeros(2, 16, 64, dtype=torch.uint8)
    )
    assert "bias must hold" in bad_call(kernels, bias=torch.zeros(3))


PORTABLE_CHECK = """
import json, torch
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.quant_pack import dequantize_packed, pack
from worker_svc.layers.quantized import w8a8_reference
from tests.fixtures.quantized import random_quantized, reference_linear
kernels = CpuKernels.load()
errors = {}
for bits, group, offsets in ((8, 100, False), (4, 32, True), (8, 32, True)):
    w = random_quantized(17, 100, bits, group, with_offsets=offsets)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 100).to(dtype)
        out = torch.empty(3, 17, dtype=dtype)
        kernels.quant_linear(out, x, pack(w), None)
        ref = reference_linear(x, w)
        errors[f"{bits}-{dtype}"] = float((out.double() - ref.double()).abs().max() / ref.abs().max())
w = random_quantized(17, 100, 8, 100, with_offsets=False)
p = pack(w, int8_order="quads")
scales = torch.zeros(32); scales[:17] = w.scales[:, 0]
sums = torch.zeros(32, dtype=torch.int32); sums[:17] = w.values.sum(1, dtype=torch.int32)
x = torch.randn(3, 100)
out = torch.empty(3, 17)
kernels.w8a8_linear(out, x, p, scales, sums, None)
errors["w8a8"] = float((out - w8a8_reference(x, p, scales, None)).abs().max())
w = pack(random_quantized(150, 328, 4, 128, with_offsets=True))
dequantized = kernels.quant_dequantize(w, torch.float32)
errors["dequantize-float32"] = float((dequantized - dequantize_packed(w).t()).abs().max())
print(json.dumps({"isa": kernels.quant_isa(), "errors": errors}))
"""


def test_portable_build_without_avx512(tmp_path: Path) -> None:
    """The library built for a CPU without AVX-512 (x86-64-v3) takes the portable loops and
    computes the same results (a machine without AVX-512 builds exactly this)."""
    env = {**os.environ, MARCH_ENV: "x86-64-v3", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", PORTABLE_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["isa"] == "portable"
    for name, error in result["errors"].items():
        assert error < (1e-6 if "float32" in name or name == "w8a8" else 1e-2), (name, error)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(37, 200, 64), (150, 328, 128)])
def test_dequantize_kernel_equals_the_reference(
    kernels: CpuKernels, bits: int, shape: tuple[int, int, int]
) -> None:
    """quant_dequantize (steps of DEQUANTIZE_ROWS tokens or more take oneDNN's matmul on it)
    writes exactly the packed weight's values transposed, rounded once to the dtype: odd row
    counts, a partial last group, and more tiles than one thread's block (8) with a partial one."""
    num_rows, num_cols, group = shape
    weight = random_quantized(num_rows, num_cols, bits, group, with_offsets=True, seed=bits)
    packed = pack(weight)
    expected = dequantize_packed(packed)
    for dtype in DTYPES:
        assert torch.equal(kernels.quant_dequantize(packed, dtype), expected.t().to(dtype))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_rows_take_the_dequantized_weight(
    kernels: CpuKernels, bits: int, dtype: torch.dtype
) -> None:
    """A step of DEQUANTIZE_ROWS tokens or more (an odd count, bias, N not a multiple of 16)
    through the weight-only method (bf16: the kernel's scaled panels; float32: oneDNN's matmul
    on the dequantized weight): the float64 product of the weight rounded once to the dtype,
    within one rounding of the result."""
    weight = random_quantized(150, 200, bits, 64, with_offsets=bits == 4, seed=3)
    method = WeightOnlyLinearMethod(kernels)
    method.packed = packed = pack(weight)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(DEQUANTIZE_ROWS + 3, 200, generator=gen).to(dtype)
    bias = torch.randn(150, generator=gen).to(dtype)
    out = method.apply(cast(LinearBase, None), x, bias)
    assert out.shape == (DEQUANTIZE_ROWS + 3, 150) and out.dtype == dtype
    rounded = dequantize_packed(packed).to(dtype).double()[:150, :200]
    expected = (x.double() @ rounded.t() + bias.double()).to(dtype)
    assert_close_to_reference(out, expected)
