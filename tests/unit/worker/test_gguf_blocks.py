"""GGUF's quantized blocks as `GroupQuantized` weights (worker_svc/quantization/gguf_blocks.py)
against gguf's own dequantize (`gguf.quants.dequantize`, the upstream reference), bit for bit.

Blocks are random bytes over every field's whole range (4/5/6-bit integers, the K-quants' 6-bit
packed scales and minimums, Q6_K's signed 8-bit scales), with their float16 fields drawn finite:
the rows a llama.cpp file can hold. Then the kernels (quant_ops.cpp) run on the converted
weight against the same reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.fixtures.quantized import assert_close_to_reference
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.quant_pack import pack
from worker_svc.quantization.gguf_blocks import CONVERTERS, group_quantized

F16_FIELDS = {  # byte offsets of each block's float16 fields
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    block_weights, block_bytes, _ = CONVERTERS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (num_rows, num_cols // block_weights, block_bytes), np.uint8)
    for offset in F16_FIELDS[type_name]:
        halves = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(num_rows, -1)


@pytest.mark.parametrize("type_name", list(CONVERTERS))
def test_conversion_equals_gguf_dequantize(type_name: str) -> None:
    num_cols = 512
    raw = random_blocks(type_name, 24, num_cols, seed=len(type_name))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    weight = group_quantized(type_name, raw, num_cols)
    assert weight.shape == (24, num_cols)
    assert np.array_equal(weight.dequantize().numpy(), expected.astype(np.float32))


def test_rows_of_the_wrong_length_are_refused() -> None:
    raw = random_blocks("Q4_K", 2, 256, seed=0)
    with pytest.raises(ValueError, match="Q4_K rows of 512 weights need 2 blocks of 144 bytes"):
        group_quantized("Q4_K", raw, 512)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_K", "Q6_K"])
def test_kernels_run_converted_weights(type_name: str) -> None:
    kernels = CpuKernels.load()
    assert kernels is not None
    raw = random_blocks(type_name, 40, 768, seed=7)
    weight = group_quantized(type_name, raw, 768)
    reference = torch.from_numpy(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    )
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 768).to(dtype)
        out = torch.empty(5, 40, dtype=dtype)
        kernels.quant_linear(out, x, pack(weight), None)
        assert_close_to_reference(out, (x.double() @ reference.t()).to(dtype))
