"""generation_config.json: the model's end-of-sequence ids, and the sampling defaults its
creator recommends, applied to every field a request leaves unset (vLLM's
`--generation-config auto`, the default; `vllm` keeps vLLM's own defaults; a folder reads that
folder's generation_config.json instead of the model's).

A field is "unset" as the contract defines it: an absent `optional` field (temperature, top_p,
repetition_penalty, max_tokens), or 0 for top_k and min_p, which vLLM treats alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder path
# generation_config.json key -> (SamplingParams field, type): vLLM's `get_diff_sampling_param`.
SAMPLING_DEFAULT_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "repetition_penalty": ("repetition_penalty", float),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "max_new_tokens": ("max_tokens", int),
}


def read_generation_config(folder: Path | None) -> dict[str, Any]:
    """The folder's generation_config.json as a dict ({} when there is none)."""
    if folder is None or not (folder / GENERATION_CONFIG_FILE).exists():
        return {}
    config = json.loads((folder / GENERATION_CONFIG_FILE).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{folder / GENERATION_CONFIG_FILE} is not a JSON object")
    return config


def generation_config_folder(mode: str, model_folder: Path | None) -> Path | None:
    """Where generation_config.json is read from: the model's folder ("auto", "vllm"; None for
    a GGUF file, which has none) or the folder `mode` names."""
    if mode in GENERATION_CONFIG_MODES:
        return model_folder
    folder = Path(mode).expanduser()
    if not (folder / GENERATION_CONFIG_FILE).exists():
        raise ValueError(
            f"--generation-config {mode!r}: no {GENERATION_CONFIG_FILE} there; use auto, vllm "
            "or a folder that holds one"
        )
    return folder


def eos_token_ids(config: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids of the generation config (a model may list several)."""
    value = config.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def sampling_defaults(config: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """SamplingParams field -> default, from the generation config's keys that vLLM reads;
    empty with `--generation-config vllm`."""
    if mode == "vllm":
        return {}
    defaults: dict[str, Any] = {}
    for key, (field, kind) in SAMPLING_DEFAULT_FIELDS.items():
        if config.get(key) is not None:
            defaults[field] = kind(config[key])
    return defaults


def log_sampling_defaults(defaults: Mapping[str, Any], mode: str) -> None:
    if defaults:
        logger.info(
            "sampling defaults from the model's generation config for fields a request leaves "
            "unset: %s (--generation-config vllm disables them)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    elif mode == "vllm":
        logger.info("sampling defaults: vLLM's own (--generation-config vllm)")
    else:
        logger.info("the generation config sets no sampling defaults; vLLM's own apply")
