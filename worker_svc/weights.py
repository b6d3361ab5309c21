"""Reading Hugging Face safetensors checkpoints: single file or sharded via the index json.

Tensors are opened lazily (`safe_open(...).get_slice`), so each rank reads only its
tensor-parallel slice of the tensors of its pipeline stage; the model decides which those are.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.model_config import parse_dtype

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, TensorSource]]:
    """Every tensor of the checkpoint as (name, lazily-readable slice), logging each shard."""
    from safetensors import safe_open

    started = time.perf_counter()
    for i, path in enumerate(files, start=1):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_slice(name)
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
