"""The GPTQ reader (worker_svc/quantization/gptq.py) bit for bit against GPTQModel's own
`dequantize_weight` on layers packed by GPTQModel (tests/fixtures/gptq_checkpoints.py), zero
points at both ends of their range included (a v1 zero point of 0 borrows from its neighbour
in the packed word); and the GPTQ configurations it refuses, each in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker_svc.quantization.gptq import GptqScheme, check_config, to_group_quantized
from worker_svc.quantization.plan import resolve_quantization

CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}


def edge_weight(num_out: int, num_in: int) -> torch.Tensor:
    """Random rows, and rows all >= 0 or all <= 0: asymmetric zero points 0 and 2^bits - 1."""
    weight = torch.randn(num_out, num_in, generator=torch.Generator().manual_seed(7))
    weight[0::4] = weight[0::4].abs()
    weight[1::4] = -weight[1::4].abs()
    return weight.half().float()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("desc_act", "sym", "is_v2", "group_size"),
    [
        (False, True, False, 32),
        (True, False, False, 32),
        (True, False, True, 32),
        (False, False, False, -1),
    ],
)
def test_reader_equals_gptqmodel_dequantize(
    bits: int, desc_act: bool, sym: bool, is_v2: bool, group_size: int
) -> None:
    from tests.fixtures.gptq_checkpoints import gptqmodel_error

    if gptqmodel_error() is not None:
        pytest.skip(str(gptqmodel_error()))
    from tests.fixtures.gptq_checkpoints import (
        act_order_g_idx,
        dequantize_layer,
        pack_layer,
        quantize_config,
    )

    qcfg = quantize_config(bits, desc_act, sym, group_size)
    weight = edge_weight(64, 96)
    parts = pack_layer(weight, qcfg, act_order_g_idx(96, desc_act, 3, group_size), is_v2)
    expected = dequantize_layer(parts, qcfg, is_v2)
    ours = to_group_quantized(parts, GptqScheme(bits, group_size, is_v2))
    assert (ours.g_idx is not None) == desc_act
    assert torch.equal(ours.dequantize(), expected)
    # The packing kept the weight (a sanity check on the rows of both signs; GPTQModel's
    # symmetric range clips one-signed rows).
    assert (expected - weight)[2::4].abs().max() < 0.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "3-bit weights"),
        ({"bits": 2}, "2-bit weights"),
        ({"checkpoint_format": "gptq_p"}, "checkpoint_format 'gptq_p'"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"is_marlin_format": True}, "is_marlin_format"),
        ({"lm_head": True}, "lm_head"),
        ({"dynamic": {"-:.*down.*": {}}}, "dynamic"),
        ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({"group_size": 0}, "group_size 0"),
    ],
)
def test_unsupported_gptq_configs_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_config({**CONFIG, **change})
    text = str(err.value)
    assert message in text and "'gptq'" in text and "not supported" in text
    assert "\n" not in text


def test_v2_and_per_row_configs_are_read() -> None:
    v2 = check_config({**CONFIG, "checkpoint_format": "gptq_v2"})
    assert v2 == GptqScheme(4, 32, is_v2=True, desc_act=True)
    per_row = check_config({**CONFIG, "bits": 8, "group_size": -1, "desc_act": False})
    assert per_row == GptqScheme(8, -1, is_v2=False)


def test_act_order_without_g_idx_is_refused() -> None:
    parts = {
        "qweight": torch.zeros(4, 32, dtype=torch.int32),
        "qzeros": torch.zeros(1, 4, dtype=torch.int32),
        "scales": torch.ones(1, 32, dtype=torch.float16),
    }
    assert to_group_quantized(parts, GptqScheme(4, 32, is_v2=False)).shape == (32, 32)
    with pytest.raises(ValueError, match="desc_act checkpoint without g_idx"):
        to_group_quantized(parts, GptqScheme(4, 32, is_v2=False, desc_act=True))


@pytest.mark.parametrize(
    ("requested", "declared", "expected"),
    [("", "gptq", "gptq"), ("gptq", "gptq", "gptq"), ("gptq_marlin", "gptq", "gptq")],
)
def test_quantization_gptq_and_its_gpu_kernel_name_serve_gptq(
    requested: str, declared: str, expected: str
) -> None:
    assert resolve_quantization(requested, declared, "tiny") == expected


@pytest.mark.parametrize(
    ("requested", "declared", "message"),
    [
        ("gptq", None, "--quantization gptq reads gptq checkpoints; tiny is not one"),
        ("awq", None, "--quantization awq reads awq checkpoints; tiny is not one"),
        ("awq", "gptq", "--quantization awq does not match tiny, which is quantized with gptq"),
        ("int4", "gptq", "is already quantized (gptq); drop --quantization"),
    ],
)
def test_quantization_that_does_not_fit_is_refused(
    requested: str, declared: str | None, message: str
) -> None:
    """A packed format asked of a float checkpoint was served as online int8 before."""
    with pytest.raises(ValueError) as err:
        resolve_quantization(requested, declared, "tiny")
    assert message in str(err.value)


def test_malformed_tensors_are_refused_naming_them() -> None:
    parts = {
        "qweight": torch.zeros(4, 32, dtype=torch.float32),
        "qzeros": torch.zeros(1, 4, dtype=torch.int32),
        "scales": torch.ones(1, 32, dtype=torch.float16),
    }
    with pytest.raises(ValueError, match="GPTQ qweight must be a 2-D torch.int32 tensor"):
        to_group_quantized(parts, GptqScheme(4, 32, is_v2=False))
    parts["qweight"] = torch.zeros(4, 32, dtype=torch.int32)
    parts["g_idx"] = torch.full((32,), 5, dtype=torch.int32)  # a group the scales do not have
    with pytest.raises(ValueError, match="g_idx must give each of the 32 columns a group < 1"):
        to_group_quantized(parts, GptqScheme(4, 32, is_v2=False))
