"""The CPU kernels of cpu_ops.cpp, attention_ops.cpp, quant_ops.cpp and w8a8_ops.cpp: built once
per machine with the system's C++ compiler, cached, loaded as torch.ops.splitserve.

A bf16 decode step of a small Llama spends a few per cent of its time in RMSNorm, rotary and
SiLU-and-mul, each of which torch runs as several kernels with a temporary per op; and its
decode attention first gathers every request's context out of the paged cache (about as many
bytes copied as read). cpu_ops.cpp does each in one pass, and attention_ops.cpp's decode
attention reads the cache in place through the block table (a bf16/float cache, or an fp8 one
converted in registers), like vLLM's CPU ops.

The quantized linear layers (layers/quantized.py) run quant_ops.cpp from the same library: int8
and int4 weights against float activations (the weight dequantized inside the dot product); and
w8a8_ops.cpp: W8A8's int8 dot products.

Built for this machine's instruction set (-march=native: the AVX-512, AVX512_BF16 and
AVX512_VNNI paths where the CPU has them, portable loops elsewhere), so the shared library is
cached under a key of the sources, the torch version, the compiler flags and the CPU's feature
flags. `SPLITSERVE_CPU_MARCH` names another -march target (e.g. x86-64-v3: no AVX-512, what the
tests build to check the portable paths). Where no compiler is found, the build fails or the
cache cannot be written, the worker logs why and runs the torch path (`CpuKernels.load`
returns None).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Protocol

import torch

from splitserve_runtime.model_cache import default_cache_dir, ensure_built

logger = logging.getLogger(__name__)

FOLDER = Path(__file__).parent
SOURCES = tuple(
    FOLDER / name
    for name in (
        "cpu_ops.cpp",
        "attention_ops.cpp",
        "quant_ops.cpp",
        "w8a8_ops.cpp",
        "sampling_ops.cpp",
    )
)
HEADERS = tuple(
    FOLDER / name
    for name in (
        "cpu_common.h",
        "attention_decode.h",
        "quant_tiles.h",
        "quant_dequant.h",
        "quant_args.h",
    )
)
LIBRARY = "cpu_ops.so"
COMPILE_FLAGS = [
    *("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"),
    *("-std=c++20", "-shared", "-fPIC", "-w"),
]
DISABLE_ENV = "SPLITSERVE_CPU_KERNELS"
"""Set to 0 to run the torch path on CPU (the kernels are then neither built nor loaded)."""
MARCH_ENV = "SPLITSERVE_CPU_MARCH"
"""The compiler's -march target (default: native, this machine's instruction set)."""


def march_flag() -> str:
    return f"-march={os.environ.get(MARCH_ENV) or 'native'}"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def cache_key() -> str:
    """What the library depends on: sources, torch, flags and the CPU's features."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    flags = " ".join([march_flag(), *COMPILE_FLAGS])
    for part in (torch.__version__, flags, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension  # imports setuptools: only when a build is due

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    return [
        *(compiler, march_flag(), *COMPILE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes),
        *(str(source) for source in SOURCES),
        *("-o", str(output)),
        *(f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"),
    ]


def _build(folder: Path) -> None:
    folder.mkdir(parents=True)
    done = subprocess.run(compile_command(folder / LIBRARY), capture_output=True, text=True)
    if done.returncode != 0:
        names = ", ".join(source.name for source in SOURCES)
        raise RuntimeError(f"compiling {names} failed:\n{done.stderr[-2000:]}")


def built_library_folder() -> Path:
    """The folder of this machine's build of the kernels in splitserve's cache (`LIBRARY` and
    nothing else; named `cache_key()` under `<cache>/kernels/`), built on first use."""
    target = default_cache_dir() / "kernels" / cache_key()
    names = ", ".join(source.name for source in SOURCES)
    return ensure_built(target, LIBRARY, _build, f"CPU kernels ({names})")


class QuantizedTiles(Protocol):
    """A weight in the quantized kernels' tile layout (layers/quant_pack.py's PackedWeight)."""

    @property
    def qweight(self) -> torch.Tensor: ...

    @property
    def scales(self) -> torch.Tensor: ...

    @property
    def offsets(self) -> torch.Tensor | None: ...

    @property
    def bounds(self) -> torch.Tensor: ...

    @property
    def cols(self) -> torch.Tensor | None: ...

    @property
    def bits(self) -> int: ...


_IN_USE: ContextVar[CpuKernels | None] = ContextVar("cpu_kernels", default=None)


@contextmanager
def using_cpu_kernels(kernels: CpuKernels | None) -> Iterator[None]:
    """Layers and attention backends built inside take their CPU-kernel implementation
    (None: the torch one); see layers/custom_op.py."""
    token = _IN_USE.set(kernels)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def current_cpu_kernels() -> CpuKernels | None:
    """The kernels of the enclosing `using_cpu_kernels`, if any."""
    return _IN_USE.get()


def is_rows(x: torch.Tensor) -> bool:
    """A [rows, width] tensor whose rows are contiguous (what the row kernels take)."""
    return x.dim() == 2 and x.stride(1) == 1


class CpuKernels:
    """torch.ops.splitserve, loaded; each method allocates its output (or works in place)."""

    def __init__(self) -> None:
        self.ops = torch.ops.splitserve

    @staticmethod
    @functools.cache
    def load() -> CpuKernels | None:
        """Build (first use on this machine) and load the kernels; None where they cannot."""
        if os.environ.get(DISABLE_ENV, "1") == "0":
            logger.info("%s=0: CPU layers run the torch path", DISABLE_ENV)
            return None
        try:
            folder = built_library_folder()
            torch.ops.load_library(str(folder / LIBRARY))
        except (OSError, RuntimeError) as err:
            logger.warning("CPU kernels unavailable, running the torch path: %s", err)
            return None
        logger.info("CPU kernels loaded from %s (set %s=0 for the torch path)", folder, DISABLE_ENV)
        return CpuKernels()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, weight, eps)
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place); returns norm(residual) * weight."""
        out = torch.empty_like(x)
        self.ops.fused_add_rms_norm(out, residual, x, weight, eps)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.ops.silu_and_mul(out, gate_up)
        return out

    def rotary_neox_(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        rotary_dim: int,
    ) -> None:
        self.ops.rotary_neox_(x, positions, cos_cache, sin_cache, rotary_dim)

    def paged_decode_attention(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """An fp8 cache (float8_e4m3fn / float8_e5m2) holds keys / k_scale, values / v_scale."""
        self.ops.paged_decode_attention(
            out, query, kv_cache, block_tables, seq_lens, scale, k_scale, v_scale
        )

    def quant_linear(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        packed: QuantizedTiles,
        bias: torch.Tensor | None,
    ) -> None:
        """out = x W^T (+ bias) for a weight in the tile layout (layers/quant_pack.py)."""
        self.ops.quant_linear(
            out,
            x,
            packed.qweight,
            packed.bits,
            packed.scales,
            packed.offsets,
            packed.bounds,
            packed.cols,
            bias,
        )

    def quant_dequantize(self, packed: QuantizedTiles, dtype: torch.dtype) -> torch.Tensor:
        """The weight transposed, in `dtype`: [chunks x 4, tiles x 16] (packed column order by
        padded output row), what `x @ out` multiplies by."""
        num_tiles, num_chunks = packed.qweight.shape[:2]
        out = torch.empty(num_chunks * 4, num_tiles * 16, dtype=dtype)
        self.ops.quant_dequantize(
            out, packed.qweight, packed.bits, packed.scales, packed.offsets, packed.bounds
        )
        return out

    def w8a8_linear(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        packed: QuantizedTiles,
        weight_scales: torch.Tensor,
        weight_sums: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        """out = x W^T (+ bias) with x quantized per token to int8 (W8A8)."""
        self.ops.w8a8_linear(out, x, packed.qweight, weight_scales, weight_sums, bias)

    def int8_quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values, float32 scales) of x's rows, vLLM's per-token convention."""
        values = torch.empty(x.shape, dtype=torch.int8)
        scales = torch.empty(x.shape[0], dtype=torch.float32)
        self.ops.int8_quantize_rows(values, scales, x)
        return values, scales

    def quant_isa(self) -> str:
        """The instruction-set paths of this build ("portable,avx512,avx512_bf16,...")."""
        return str(self.ops.quant_isa())

    def lora_add_(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        runs: torch.Tensor,
        col_offsets: torch.Tensor,
        slot_ranks: torch.Tensor,
    ) -> None:
        """y[a:b] += x[a:b] A_s^T B_s in place for every run (slot s, a, b) (layers/lora.py)."""
        self.ops.lora_add_(y, x, lora_a, lora_b, runs, col_offsets, slot_ranks)

    def apply_token_bitmask_(
        self,
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        logit_rows: torch.Tensor,
        mask_rows: torch.Tensor,
    ) -> None:
        """logits[logit_rows[k], t] = -inf in place wherever bit t of bitmask[mask_rows[k]] is
        0 (float32 logits, int32 packed words, little-endian bit order)."""
        self.ops.apply_token_bitmask_(logits, bitmask, logit_rows, mask_rows)
