"""Reading checkpoints: Hugging Face safetensors folders (single file or sharded via the index
json) and GGUF files (splitserve_runtime.gguf_checkpoint: quantized weights kept quantized on CPU,
worker_svc/quantization/gguf.py; others, and all with --dequantize-gguf, dequantized when read).
`--quantization` is checked against the checkpoint here (worker_svc/quantization/plan.py), the
format's config comes from the quantization registry (quantization/config.py) and is read by its
kind, and a quantized checkpoint carries the planner of its layers' methods.

Tensors are opened lazily (`safe_open(...).get_slice`), so each rank reads only its
tensor-parallel slice of the tensors of its pipeline stage; the model decides which those are.
FP8 checkpoints (layers/fp8.py) are scanned once for their scales, which then travel with each
FP8 weight. Loading shows vLLM's progress bar ("Loading safetensors checkpoint shards", or per
tensor for a GGUF file) when asked (rank 0, text logs); otherwise each shard is a log line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from splitserve_runtime.model_source import ModelSource
from splitserve_runtime.quantization_names import canonical_quantization, quantization_format
from worker_svc.layers.fp8 import (
    SCALE_SUFFIXES,
    Fp8Format,
    Fp8LinearMethod,
    Fp8LinearMethods,
    fp8_weights,
)
from worker_svc.layers.linear import LinearBase
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.interfaces import CausalLM
from worker_svc.models.model_config import (
    architecture_of,
    parse_dtype,
    quant_method,
    read_hf_config,
    refuse_quantization,
)
from worker_svc.models.registry import model_class
from worker_svc.quantization.config import PackedConfig, get_quantization_config
from worker_svc.quantization.fp8 import Fp8Config
from worker_svc.quantization.mxfp4 import Mxfp4Config
from worker_svc.quantization.online import OnlineConfig
from worker_svc.quantization.plan import (
    Planner,
    check_device,
    compressed_tensors_planner,
    gguf_planner,
    make_quantization_config,
    online_planner,
    resolve_quantization,
)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SHARDS_PROGRESS = "Loading safetensors checkpoint shards"
"""vLLM's words for its weight-loading bar (operators grep for them)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint's scan found: its layout, every tensor name and the FP8 weights
    (those with a scale)."""

    fmt: Fp8Format
    tensor_names: list[str]
    quantized: set[str]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An opened checkpoint: its transformers configuration, its tensors (read on demand) and
    the dtype they are stored in."""

    hf_config: Any
    stored_dtype: torch.dtype
    weights: Callable[[bool], Iterator[tuple[str, TensorSource]]]
    """weights(show_progress): every tensor, once."""
    fp8: Fp8Checkpoint | None = None
    planner: Planner | None = None
    """Which layers hold quantized weights (None: none, or the FP8 rules of `fp8`)."""


@dataclass(frozen=True, slots=True)
class QuantizationOptions:
    """`--quantization` ("": the checkpoint's own) and `--dequantize-gguf`, and the device."""

    requested: str = ""
    dequantize_gguf: bool = False
    device_type: str = "cpu"


def open_checkpoint(source: ModelSource, options: QuantizationOptions | None = None) -> Checkpoint:
    """The configuration and tensors of a resolved model; refuses an architecture we have no
    model code for, or a `--quantization` that does not fit, before anything else is read."""
    options = options or QuantizationOptions()
    check_device(options.requested, options.device_type)
    gguf_file = source.gguf_file
    if gguf_file is not None:
        return open_gguf_checkpoint(gguf_file, options)
    declared = json.loads((source.path / "config.json").read_text()).get("architectures") or []
    if declared:
        model_class(str(declared[0]))  # before transformers parses a model type it may not know
    files = checkpoint_files(source.path)
    hf_config = read_hf_config(source.path)
    refuse_quantization(hf_config)  # a quant_method no registry row reads from config.json
    quantization = as_dict(getattr(hf_config, "quantization_config", None)) or (
        quantize_config_json(source.path, options.requested)
    )
    declared_method = quant_method(quantization) if quantization else None
    method = resolve_quantization(
        options.requested, declared_method, str(source.spec or "the model")
    )
    config = make_quantization_config(method, quantization)
    if isinstance(config, Fp8Config):
        return open_fp8_checkpoint(hf_config, files, config.scheme)
    if isinstance(config, PackedConfig):
        return open_packed_checkpoint(hf_config, files, config)
    if isinstance(config, Mxfp4Config):
        refuse_unless_reads_mxfp4(hf_config)
        return Checkpoint(hf_config, stored_dtype(files), lambda show: iter_checkpoint(files, show))
    planner = None
    if isinstance(config, OnlineConfig):
        planner = online_planner(config, tensor_names(files))
    elif config is not None:
        raise ValueError(f"quantization method {method!r} is not read from a checkpoint folder")
    return Checkpoint(
        hf_config,
        stored_dtype(files),
        lambda show_progress: iter_checkpoint(files, show_progress),
        planner=planner,
    )


def refuse_unless_reads_mxfp4(hf_config: Any) -> None:
    """MXFP4 experts are read by the model that declares it (`reads_mxfp4`: gpt-oss)."""
    architecture = architecture_of(hf_config)
    if not getattr(model_class(architecture), "reads_mxfp4", False):
        raise ValueError(
            f"an mxfp4 checkpoint of {architecture} is not supported: mxfp4 is read for "
            "gpt-oss's experts (GptOssForCausalLM) only"
        )


def as_dict(quantization: Any) -> dict[str, Any] | None:
    """A `quantization_config` as a dict (transformers may have made it an object)."""
    if not quantization or isinstance(quantization, dict):
        return quantization or None
    to_dict = getattr(quantization, "to_dict", None)
    return dict(to_dict() if to_dict is not None else vars(quantization))


def quantize_config_json(path: Path, requested: str) -> dict[str, Any] | None:
    """A file beside a config.json without quantization_config that the format `--quantization`
    names reads as one (as vLLM does: AutoGPTQ's `quantize_config.json` for gptq)."""
    method = canonical_quantization(requested)
    if not method or quantization_format(method).reads != "checkpoint":
        return None
    for name in get_quantization_config(method).get_config_filenames():
        if (path / name).is_file():
            return {"quant_method": method, **json.loads((path / name).read_text())}
    return None


def open_packed_checkpoint(hf_config: Any, files: list[Path], config: PackedConfig) -> Checkpoint:
    """A checkpoint in a packed format (compressed-tensors, AWQ, GPTQ): each quantized layer's
    tensors read as one quantized weight (`config.make_source`)."""
    from worker_svc.quantization import compressed_tensors as ct

    method = config.get_name()
    names = tensor_names(files)
    parts = ct.layer_parts(names, config.layer_tensors, config.marker)
    layers = set(parts.values())
    if not layers:
        raise ValueError(
            f"quantization method {method!r}: the checkpoint holds no quantized layer tensors "
            "(its weights are not stored as its quantization_config says); not supported"
        )
    grouped = [n for n in names if n not in parts] + sorted(layers)

    def weights(show_progress: bool) -> Iterator[tuple[str, TensorSource]]:
        return ct.group_layers(iter_checkpoint(files, show_progress), parts, config.make_source)

    planner = compressed_tensors_planner(grouped, layers, config.is_w8a8, method)
    return Checkpoint(hf_config, stored_dtype(files), weights, planner=planner)


def open_gguf_checkpoint(path: Path, options: QuantizationOptions) -> Checkpoint:
    """A GGUF file: its quantized weights kept quantized on CPU (unless --dequantize-gguf);
    everything else (and everything on CUDA, which has no int8/int4 kernels here) dequantized
    to float32 when read, exactly."""
    from splitserve_runtime.gguf_checkpoint import GgufCheckpoint
    from worker_svc.quantization.gguf import GgufConfig, GgufQuantizedTensor, is_quantized_gguf

    gguf = GgufCheckpoint(path)
    config = gguf.hf_config()
    model_class(config.architectures[0])
    resolve_quantization(options.requested, GgufConfig.get_name(), path.name)
    keep = not options.dequantize_gguf and options.device_type == "cpu"
    if not keep and not options.dequantize_gguf:
        logger.info("GGUF weights dequantized at load: no int8/int4 kernels on this device")
    tensors = list(gguf.tensors())
    quantized = {name for name, t in tensors if keep and is_quantized_gguf(t)}

    def gguf_weights(show_progress: bool) -> Iterator[tuple[str, TensorSource]]:
        sources = (
            (name, GgufQuantizedTensor(t) if name in quantized else t) for name, t in gguf.tensors()
        )
        return progress(sources, len(tensors), "Loading GGUF tensors", show_progress)

    planner = gguf_planner([name for name, _ in tensors], quantized) if quantized else None
    # Dequantized values are exact in float32; `--dtype` picks another serving dtype.
    return Checkpoint(config, torch.float32, gguf_weights, planner=planner)


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name of a safetensors checkpoint."""
    from safetensors import safe_open

    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            names.extend(shard.keys())
    return names


def open_fp8_checkpoint(hf_config: Any, files: list[Path], fmt: Fp8Format) -> Checkpoint:
    """An FP8 checkpoint whose weights read dequantized unless a layer keeps them FP8."""
    from safetensors import safe_open

    names: list[str] = []
    fp8_names: list[str] = []
    scales: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                names.append(name)
                if name.endswith(SCALE_SUFFIXES):
                    scales[name] = shard.get_tensor(name)
                elif shard.get_slice(name).get_dtype().startswith("F8"):
                    fp8_names.append(name)
    quantized = {n for n in names if f"{n}_scale_inv" in scales or f"{n}_scale" in scales}
    unscaled = [n for n in fp8_names if n not in quantized]
    if unscaled:
        raise ValueError(f"fp8 tensor {unscaled[0]} has no weight_scale or weight_scale_inv")
    logger.info("fp8 checkpoint: %d FP8 weights, block size %s", len(quantized), fmt.block_size)
    return Checkpoint(
        hf_config,
        stored_dtype(files),
        lambda show_progress: fp8_weights(iter_checkpoint(files, show_progress), scales, fmt),
        Fp8Checkpoint(fmt, [n for n in names if not n.endswith(SCALE_SUFFIXES)], quantized),
    )


def fp8_linear_methods(model: CausalLM, fp8: Fp8Checkpoint) -> Fp8LinearMethods:
    """The linear methods that keep FP8 the layers of `model` whose checkpoint weights are all
    FP8 (a layer fusing FP8 and unquantized tensors stays unquantized; one whose slice does not
    fit the FP8 kernels too). `model` only needs its structure: it may be built on the meta
    device."""
    kept: set[str] = set()
    mixed: set[str] = set()
    for name in fp8.tensor_names:
        for target in model.resolve_weight_name(name):
            path = model.target_path(target)
            if path is None or not isinstance(model.get_submodule(path), LinearBase):
                continue
            (kept if name in fp8.quantized else mixed).add(path)
    return Fp8LinearMethods(fp8.fmt, frozenset(kept - mixed))


def num_fp8_layers(model: CausalLM) -> int:
    """How many linear layers of `model` hold FP8 weights."""
    return sum(
        isinstance(m, LinearBase)
        and isinstance(getattr(m.method, "base", m.method), Fp8LinearMethod)  # LoRA wraps it
        for m in model.modules()
    )


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in index order when sharded."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    index = folder / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names missing shards: {', '.join(missing)}")
        return [folder / n for n in names]
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def progress(items: Iterator[T], total: int, desc: str, is_shown: bool) -> Iterator[T]:
    """`items`, with tqdm's bar on stderr when `is_shown`."""
    if not is_shown:
        yield from items
        return
    with tqdm(total=total, desc=desc, file=sys.stderr, unit="") as bar:
        for item in items:
            yield item
            bar.update(1)


def iter_checkpoint(
    files: list[Path], show_progress: bool = False
) -> Iterator[tuple[str, TensorSource]]:
    """Every tensor of the checkpoint as (name, lazily-readable slice); a progress bar over the
    shards when `show_progress`, else a log line per shard."""
    from safetensors import safe_open

    started = time.perf_counter()
    shards = progress(iter(files), len(files), SHARDS_PROGRESS, show_progress)
    for i, path in enumerate(shards, start=1):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_slice(name)
        if not show_progress:
            logger.info(
                "loaded shard %d/%d (%s) after %.1fs",
                i,
                len(files),
                path.name,
                time.perf_counter() - started,
            )


def stored_dtype(files: list[Path]) -> torch.dtype:
    """dtype of the checkpoint's first floating tensor (float32 when there is none)."""
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt", device="cpu") as shard:
        for name in shard.keys():  # noqa: SIM118
            code = shard.get_slice(name).get_dtype()
            if code in _SAFETENSORS_DTYPES:
                return parse_dtype(_SAFETENSORS_DTYPES[code])
    return torch.float32


def resolve_compute_dtype(
    requested: str, checkpoint_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype, except float16 on CPU, which runs as float32."""
    if requested in ("", "auto"):
        if checkpoint_dtype == torch.float16 and device.type == "cpu":
            return torch.float32
        return checkpoint_dtype
    return parse_dtype(requested)


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the distinct parameters and buffers (FP8 weights) this rank holds (tied weights
    counted once)."""
    seen: dict[int, int] = {}
    for param in [*model.parameters(), *model.buffers()]:
        seen[id(param)] = param.numel() * param.element_size()
    return sum(seen.values())
