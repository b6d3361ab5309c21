"""What `--model` names, decided from its text alone (nothing fetched, no torch): the flags that
name a model, the kind of source a spec is, and the name clients see. The engine core, which
reads no model, uses only this; model_source.py resolves a spec to local files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from splitserve_runtime.flags import Flag, flag

TINY_MODEL = "tiny"
GGUF_SUFFIX = ".gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The default model's served name (default_model.py fetches it)."""
TINY_MODEL_DIRNAME = "tiny-llama-v1"
"""The tiny test model's folder and served name (tiny_model.py builds it)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's `--dtype` spellings and the name each stands for."""
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class ModelSourceError(ValueError):
    """The model (or tokenizer) cannot be found or fetched; the message is one line."""


def model_flags(*, is_frontend: bool) -> list[Flag]:
    """vLLM's --model and --revision, and for whoever tokenizes, --tokenizer and
    --generation-config."""
    rows = [
        flag(
            "--model",
            default="",
            help="checkpoint folder, .gguf file, Hub id org/name, or tiny (a tiny random test "
            "model); default: SmolLM2-135M-Instruct, fetched once",
        ),
        flag("--revision", default="", help="Hub revision of a Hub id --model"),
    ]
    if not is_frontend:
        return rows
    return [
        *rows,
        flag(
            "--tokenizer",
            default="",
            help="tokenizer folder, .gguf file or Hub id (default: --model)",
        ),
        flag(
            "--generation-config",
            default="auto",
            help="auto: the model's generation_config.json sampling defaults fill unset request "
            "fields; vllm: vLLM's own defaults; or a folder holding a generation_config.json",
        ),
    ]


def canonical_dtype(name: str) -> str:
    """`--dtype` as the workers name it: half -> float16, float -> float32."""
    return DTYPE_ALIASES.get(name, name)


def model_kind(spec: str) -> str:
    """What `spec` names, without fetching anything."""
    if not spec:
        return "default"
    if spec == TINY_MODEL:
        return "tiny"
    path = Path(spec).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file() and spec.endswith(GGUF_SUFFIX):
        return "gguf"
    if path.exists():
        raise ModelSourceError(
            f"model {spec!r} is a file but not a .gguf; pass a checkpoint folder or a .gguf file"
        )
    if HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return "hub"
    raise ModelSourceError(
        f"model path {spec!r} does not exist (nor is it a Hugging Face Hub id like org/name)"
    )


def served_model_name(spec: str) -> str:
    """The name clients see when `--served-model-name` is not given: the Hub id, the folder's
    or file's name. Decided from the text alone (the engine core need not see the files)."""
    if not spec:
        return DEFAULT_MODEL_NAME
    if spec == TINY_MODEL:
        return TINY_MODEL_DIRNAME
    path = Path(os.path.normpath(spec))
    if spec.endswith(GGUF_SUFFIX):
        return path.stem
    if HUB_ID.match(spec) and not path.expanduser().exists():
        return spec
    return path.name
