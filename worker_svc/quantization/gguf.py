"""A GGUF file's quantized tensors as `QuantizedSource`s: the blocks converted (exactly, see
gguf_blocks.py) when a layer first reads them, the llama.cpp q/k row permutation undone on the
integers and scales (rows move whole, so nothing is rounded)."""

from __future__ import annotations

from typing import Any, Self

import numpy as np
import torch

from splitserve_runtime.gguf_checkpoint import GgufTensor, unpermute_rows
from worker_svc.layers.quant_pack import GroupQuantized
from worker_svc.layers.quant_source import Index, QuantizedTensor
from worker_svc.quantization.config import QuantizationConfig
from worker_svc.quantization.gguf_blocks import group_quantized, is_convertible


class GgufConfig(QuantizationConfig):
    """vLLM's GGUFConfig: the registry's `gguf`, a .gguf file (its tensors say their block
    formats; there is no quantization_config to read)."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls()

    @classmethod
    def float_refusal(cls, what: str) -> str:
        return f"--quantization gguf needs a .gguf file; {what} is not one"


def type_name(tensor: GgufTensor) -> str:
    return str(tensor.tensor.tensor_type.name)


def is_quantized_gguf(tensor: GgufTensor) -> bool:
    """A 2-D tensor in a block format the kernels take as it is."""
    return len(tensor.get_shape()) == 2 and is_convertible(type_name(tensor))


class GgufQuantizedTensor:
    """One quantized GGUF tensor [out, in]: quantized slices, or float32 ones (gguf's own
    dequantization) for a reader that wants floats."""

    def __init__(self, tensor: GgufTensor) -> None:
        self.tensor = tensor
        self._weight: QuantizedTensor | None = None

    def get_shape(self) -> list[int]:
        return self.tensor.get_shape()

    def weight(self) -> QuantizedTensor:
        if self._weight is None:
            num_rows, num_cols = self.get_shape()
            raw = np.asarray(self.tensor.tensor.data).reshape(num_rows, -1)
            weight = group_quantized(type_name(self.tensor), raw, num_cols)
            if self.tensor.permute_heads is not None:
                weight = permute_rows(weight, self.tensor.permute_heads)
            self._weight = QuantizedTensor(weight)
        return self._weight

    def quantized(self, index: Index) -> GroupQuantized:
        return self.weight().quantized(index)

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.tensor[index]

    def row_range(self, start: int, num_rows: int) -> QuantizedTensor:
        return self.weight().row_range(start, num_rows)


def permute_rows(weight: GroupQuantized, num_heads: int) -> GroupQuantized:
    """llama.cpp's q/k rows back in Hugging Face order (gguf_checkpoint.unpermute_rows)."""
    order = torch.from_numpy(unpermute_rows(np.arange(weight.shape[0]), num_heads).copy())
    return weight.rows(order)
