"""Reading checkpoints: Hugging Face safetensors folders (single file or sharded via the index
json) and GGUF files (splitserve_runtime.gguf_checkpoint, dequantized when read).

Tensors are opened lazily (`safe_open(...).get_slice`), so each rank reads only its
tensor-parallel slice of the tensors of its pipeline stage; the model decides which those are.
Loading shows vLLM's progress bar ("Loading safetensors checkpoint shards", or per tensor for a
GGUF file) when asked (rank 0, text logs); otherwise each shard is a log line.
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
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.model_config import parse_dtype, read_hf_config
from worker_svc.models.registry import model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SHARDS_PROGRESS = "Loading safetensors checkpoint shards"
"""vLLM's words for its weight-loading bar (operators grep for them)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An opened checkpoint: its transformers configuration, its tensors (read on demand) and
    the dtype they are stored in."""

    hf_config: Any
    stored_dtype: torch.dtype
    weights: Callable[[bool], Iterator[tuple[str, TensorSource]]]
    """weights(show_progress): every tensor, once."""


def open_checkpoint(source: ModelSource) -> Checkpoint:
    """The configuration and tensors of a resolved model; refuses an architecture we have no
    model code for before anything else is read."""
    if source.is_gguf:
        from splitserve_runtime.gguf_checkpoint import GgufCheckpoint

        gguf = GgufCheckpoint(source.path)
        config = gguf.hf_config()
        model_class(config.architectures[0])
        # Dequantized values are exact in float32; `--dtype` picks another serving dtype.
        num_tensors = len(gguf.reader.tensors)

        def gguf_weights(show_progress: bool) -> Iterator[tuple[str, TensorSource]]:
            return progress(gguf.tensors(), num_tensors, "Loading GGUF tensors", show_progress)

        return Checkpoint(config, torch.float32, gguf_weights)
    declared = json.loads((source.path / "config.json").read_text()).get("architectures") or []
    if declared:
        model_class(str(declared[0]))  # before transformers parses a model type it may not know
    files = checkpoint_files(source.path)
    return Checkpoint(
        read_hf_config(source.path),
        stored_dtype(files),
        lambda show_progress: iter_checkpoint(files, show_progress),
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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters this rank holds (tied weights counted once)."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[id(param)] = param.numel() * param.element_size()
    return sum(seen.values())
