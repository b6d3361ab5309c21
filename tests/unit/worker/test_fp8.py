"""FP8 tensor reading: block scales over slices that cut blocks, fused parts, and checkpoints
whose FP8 tensors lack a scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.fixtures.fp8_checkpoints import quantize
from worker_svc.layers.fp8 import Fp8Format, Fp8Tensor
from worker_svc.layers.tensor_source import InMemoryTensor, read_cols, read_rows, row_range
from worker_svc.model_loader.weights import checkpoint_files, open_fp8_checkpoint

BLOCK = (4, 6)


def fp8_tensor(rows: int, cols: int) -> tuple[Fp8Tensor, torch.Tensor]:
    """An FP8 source of a random weight whose shape cuts the blocks, and its exact dequant."""
    values, scale = quantize(torch.randn(rows, cols), BLOCK)
    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    return Fp8Tensor(InMemoryTensor(values), scale, Fp8Format(BLOCK)), values.float() * full


def test_slices_that_cut_blocks_dequantize_with_their_own_scales() -> None:
    source, dense = fp8_tensor(11, 17)
    assert torch.equal(source[:], dense)
    assert torch.equal(read_rows(source, 3, 5), dense[3:8])
    assert torch.equal(read_cols(source, 5, 9), dense[:, 5:14])
    assert torch.equal(source[2:9, 7:17], dense[2:9, 7:17])


def test_a_fused_part_keeps_its_block_scales() -> None:
    source, dense = fp8_tensor(12, 12)
    part = row_range(source, 4, 8)
    assert isinstance(part, Fp8Tensor)
    assert torch.equal(part[:], dense[4:])
    assert torch.equal(read_rows(part, 2, 3), dense[6:9])
    with pytest.raises(ValueError, match="block"):
        row_range(source, 2, 8)


def test_an_fp8_tensor_without_a_scale_is_refused(tmp_path: Path) -> None:
    values, _ = quantize(torch.randn(8, 8), None)
    save_file({"model.layers.0.mlp.down_proj.weight": values}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="down_proj.weight has no weight_scale"):
        open_fp8_checkpoint(None, checkpoint_files(tmp_path), Fp8Format(None))
