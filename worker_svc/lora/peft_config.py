"""An adapter folder's adapter_config.json (PEFT's LoraConfig), read and checked as vLLM's
PEFTHelper does: what changes an adapter's meaning and is not implemented here is refused with
one line saying so, rather than served wrongly."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
MAX_PATH_CHARS = 4096
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""init_lora_weights values that only set the initial weights (a saved adapter is a plain LoRA);
the others (PiSSA, OLoRA, LoftQ, ...) change the base weights, which this server does not."""


class AdapterError(ValueError):
    """An adapter that cannot be served, and why (one line)."""


class AdapterNotFound(AdapterError):
    """No adapter at the path (vLLM's LoRAAdapterNotFoundError)."""


@dataclass(frozen=True, slots=True)
class PeftLoraConfig:
    """The fields of a PEFT LoRA config that decide how its weights apply."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def rank_and_scaling(self, module: str) -> tuple[int, float]:
        """PEFT's rank and scaling of `module` (its path in the adapter, without
        `base_model.model.`): rank_pattern / alpha_pattern keys match a suffix of the path
        starting at a "." boundary, the first match wins."""
        rank = _match(self.rank_pattern, module)
        alpha = _match(self.alpha_pattern, module)
        rank = self.r if rank is None else int(rank)
        alpha = self.lora_alpha if alpha is None else float(alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _match(pattern: dict[str, Any], name: str) -> Any:
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def adapter_folder(lora_path: str) -> Path:
    """The adapter's folder: an absolute path without '..' holding adapter_config.json and
    adapter_model.safetensors (a pickled adapter_model.bin is refused: it could run code)."""
    if not lora_path or len(lora_path) > MAX_PATH_CHARS or "\x00" in lora_path:
        raise AdapterError("lora_path must be a folder's absolute path")
    pure = PurePosixPath(lora_path)
    if not pure.is_absolute() or ".." in pure.parts:
        raise AdapterError(
            f"lora_path {lora_path!r} must be an absolute path without '..' (the adapter's folder "
            "on the worker ranks)"
        )
    folder = Path(lora_path)
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterNotFound(f"No adapter found for {lora_path}: it has no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / PICKLE_WEIGHTS_FILE).is_file():
            raise AdapterError(
                f"{lora_path} holds {PICKLE_WEIGHTS_FILE}, a pickle file, which is never loaded; "
                "save the adapter as safetensors (PEFT's save_pretrained default)"
            )
        raise AdapterNotFound(f"No adapter found for {lora_path}: it has no {WEIGHTS_FILE}")
    return folder


def read_peft_config(folder: Path, max_lora_rank: int) -> PeftLoraConfig:
    """The folder's LoRA config, refused when it asks for what is not implemented or its rank
    exceeds `max_lora_rank`."""
    path = folder / CONFIG_FILE
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    problems = _unsupported(raw)
    config = _parse(raw)
    if config.max_rank > max_lora_rank:
        problems.append(
            f"LoRA rank {config.max_rank} is greater than max_lora_rank {max_lora_rank}."
        )
    if problems:
        raise AdapterError(" ".join(problems))
    return config


def _parse(raw: dict[str, Any]) -> PeftLoraConfig:
    r, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"LoRA rank `r` must be a positive integer, got {r!r}.")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}.")
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not isinstance(alphas, dict):
        raise AdapterError("rank_pattern and alpha_pattern must be JSON objects.")
    for key, rank in ranks.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise AdapterError(f"rank_pattern[{key!r}] must be a positive integer, got {rank!r}.")
    for key, value in alphas.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise AdapterError(f"alpha_pattern[{key!r}] must be a number, got {value!r}.")
    return PeftLoraConfig(r, float(alpha), bool(raw.get("use_rslora")), ranks, alphas)


def _unsupported(raw: dict[str, Any]) -> list[str]:
    """What the config asks for that this server does not do (vLLM's refusals)."""
    problems = []
    if raw.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {raw.get('peft_type')!r} is not LoRA.")
    if raw.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported.")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        problems.append("Adapter bias is not supported.")
    if raw.get("modules_to_save"):
        problems.append(
            f"modules_to_save {raw['modules_to_save']!r} is not supported (fully trained "
            "modules beside the LoRA weights)."
        )
    if raw.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out (Conv1D weights) is not supported.")
    if raw.get("layer_replication"):
        problems.append("layer_replication is not supported.")
    if raw.get("alora_invocation_tokens"):
        problems.append("Activated LoRA (aLoRA) is not supported.")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        problems.append(
            f"init_lora_weights={init!r} is not supported: it changes the base model's "
            "weights; convert the adapter to a plain LoRA with PEFT first."
        )
    return problems
