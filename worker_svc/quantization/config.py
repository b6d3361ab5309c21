"""The worker's half of the quantization registry (vLLM's `QuantizationConfig` and
`get_quantization_config`): one config class per format, in that format's file, found through
its row in splitserve_runtime/quantization_names.py and imported on first use (serving one
format never imports another's libraries).

A config is made from the checkpoint's `quantization_config` (`from_config`) and refuses there,
in one line, what its readers cannot serve. How its weights are read follows from its kind:

    PackedConfig    each quantized layer's tensors (`layer_tensors`, marked by `marker`) read
                    as one quantized source (`make_source`): compressed-tensors, AWQ, GPTQ
    Fp8Config       (quantization/fp8.py) FP8 weights with their scales
    OnlineConfig    (quantization/online.py) a float checkpoint quantized at load
    GgufConfig      (quantization/gguf.py) a .gguf file's blocks

A new format of an existing kind is its file and its row; a new kind also needs its reader in
worker_svc/model_loader/weights.py.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Self, TypeVar

from splitserve_runtime.quantization_names import FORMATS, quantization_format
from worker_svc.layers.tensor_source import TensorSource

Scheme = TypeVar("Scheme")


class QuantizationConfig(ABC):
    """A format's reading of a checkpoint's `quantization_config` (vLLM's base class)."""

    @classmethod
    def get_name(cls) -> str:
        """vLLM's name for the format: the registry row naming this class."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        return next(f.name for f in FORMATS if f.config_class == path)

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        """The config of a checkpoint's `quantization_config`; ValueError naming what its
        readers cannot serve."""

    @classmethod
    def get_config_filenames(cls) -> tuple[str, ...]:
        """Files beside config.json read as the `quantization_config` when config.json has
        none and `--quantization` names this format (vLLM's, e.g. AutoGPTQ's
        quantize_config.json)."""
        return ()

    @classmethod
    def float_refusal(cls, what: str) -> str:
        """Why `--quantization <name>` cannot serve `what`, a float checkpoint."""
        name = cls.get_name()
        return f"--quantization {name} reads {name} checkpoints; {what} is not one"


class SchemeConfig(QuantizationConfig, Generic[Scheme]):
    """A format's config that is its `scheme`: what `parse_scheme` read from the checkpoint's
    `quantization_config`."""

    parse_scheme: Callable[[dict[str, Any]], Scheme]
    """The format's reading of a `quantization_config`; ValueError naming what it refuses."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(cls.parse_scheme(config))


class PackedConfig(SchemeConfig[Scheme]):
    """A format whose layers store packed integers, grouped into one quantized source each."""

    layer_tensors: ClassVar[tuple[str, ...]]
    """A quantized layer's tensors (the local names after its prefix)."""
    marker: ClassVar[str]
    """The local name of the tensor that makes a layer a quantized one."""

    @property
    def is_w8a8(self) -> bool:
        """Whether the activations are quantized too (else weight-only)."""
        return False

    @abstractmethod
    def make_source(self, layer: dict[str, TensorSource]) -> TensorSource:
        """One layer's tensors (by local name) as its quantized `.weight` source."""


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    """The config class of `name` (or of an alias of it: gptq_marlin is gptq); ValueError
    naming the known methods for any other name."""
    module, _, attr = quantization_format(name).config_class.partition(":")
    config_class = getattr(importlib.import_module(module), attr)
    assert issubclass(config_class, QuantizationConfig), config_class
    return config_class
