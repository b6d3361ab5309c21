"""How a pooling model pools, as its checkpoint says (vLLM's PoolerConfig from the
sentence-transformers files): modules.json lists the pipeline (Transformer, Pooling, optional
Normalize), the Pooling module's config.json says which tokens it pools. A pipeline with modules
we do not run (Dense, WeightedMean, ...) is refused in one line: its vectors would differ.

Without modules.json (a plain checkpoint served with --convert embed) vLLM's default for a
decoder applies: the last token's hidden state, normalized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitserve_contracts.output_types import PoolerConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
"""sentence-transformers' pooling_mode -> ours (max, mean_sqrt_len_tokens, weightedmean: not
supported)."""
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
"""The boolean keys of sentence-transformers before 6.0 -> pooling_mode."""
MAX_CONFIG_BYTES = 1 << 20


def read_pooler_config(folder: Path | None, hf: Any, hidden_size: int) -> PoolerConfig:
    """The PoolerConfig of the checkpoint in `folder` (None: no files, e.g. a GGUF); ValueError
    (one line) for a sentence-transformers pipeline we cannot reproduce."""
    pooling_type, normalize = "LAST", True
    modules = _read_json(folder / "modules.json") if folder is not None else None
    if modules is not None:
        assert folder is not None
        pooling_type, normalize = _from_modules(folder, modules)
    dims = getattr(hf, "matryoshka_dimensions", None) or []
    if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ValueError("config.json: matryoshka_dimensions must be a list of positive ints")
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=hidden_size,
        matryoshka_dimensions=sorted(d for d in dims if d <= hidden_size),
        is_matryoshka=bool(getattr(hf, "is_matryoshka", False)) or bool(dims),
        task="embed",
    )


def _from_modules(folder: Path, modules: Any) -> tuple[str, bool]:
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError("modules.json must be a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(
            f"sentence-transformers pipeline {' -> '.join(kinds)} is not supported; "
            "supported: Transformer -> Pooling [-> Normalize]"
        )
    path = folder / str(modules[1].get("path", "")) / "config.json"
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path.parent.name}/config.json is missing or not an object")
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_MODES.items() if config.get(key)]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in _MODES or config.get("include_prompt", True) is not True:
        raise ValueError(
            f"pooling mode {mode!r} is not supported: one of {', '.join(_MODES)}, with the "
            "prompt included"
        )
    return _MODES[mode], kinds[-1] == "Normalize"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path.name} is not valid JSON: {err}") from None


def is_pooling_runner(runner: str, convert: str, has_lm_head: bool) -> bool:
    """Whether the rank serves the model for pooling (vLLM's --runner/--convert): asked for, or
    "auto" on a checkpoint without an LM head; ValueError when generation cannot run."""
    if runner == "pooling" or convert == "embed":
        if runner == "generate":
            raise ValueError("--convert embed serves a pooling model; it needs --runner pooling")
        return True
    if runner == "generate" and not has_lm_head:
        raise ValueError(
            "the checkpoint has no language-model head (a bare decoder, e.g. saved by "
            "sentence-transformers): serve it with --runner pooling"
        )
    return not has_lm_head


def classifier_config(num_labels: int) -> PoolerConfig:
    """A sequence classifier's pooler (vLLM's for *ForSequenceClassification): the last
    token's state through the head; its scores, not normalized."""
    return PoolerConfig(
        pooling_type="LAST", normalize=False, hidden_size=num_labels, task="classify"
    )
