"""Ops that pick their implementation once, when they are built (vLLM's `CustomOp`).

A layer with more than one implementation subclasses `CustomOp` and writes `forward_native`
(plain torch, everywhere) and, where it has one, `forward_cpu_kernels` (worker_svc/kernels).
The constructor binds `forward` to one of them for the layer's life: the CPU kernels' version
when the model is built inside `using_cpu_kernels(kernels)` and the op has one, else the native
one. Nothing is patched in after construction, and no forward asks which kernels are loaded.
An op with a second entry point (RMSNorm's `add_and_norm`) binds it with `choose`.

A CUDA implementation (`forward_cuda`) would be chosen the same way, by the device the model is
built for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from torch import nn

from worker_svc.kernels.cpu_kernels import CpuKernels, current_cpu_kernels

F = TypeVar("F", bound=Callable[..., Any])


class CustomOp(nn.Module):
    """A module whose `forward` is one of its implementations, chosen at construction.

    `implementation` names the one chosen ("cpu_kernels" or "native"); `kernels` is set only
    when it is "cpu_kernels" (and read only by those implementations)."""

    has_cpu_kernels: ClassVar[bool] = False
    """Whether the subclass writes `forward_cpu_kernels`."""
    kernels: CpuKernels

    def __init__(self) -> None:
        super().__init__()
        kernels = current_cpu_kernels()
        self.implementation = "native"
        if kernels is not None and self.has_cpu_kernels:
            self.kernels = kernels
            self.implementation = "cpu_kernels"
        self._forward = self.choose(self.forward_native, self.forward_cpu_kernels)

    def choose(self, native: F, cpu_kernels: F) -> F:
        """The implementation of one entry point this op runs with."""
        return cpu_kernels if self.implementation == "cpu_kernels" else native

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu_kernels(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"implementation={self.implementation}"
