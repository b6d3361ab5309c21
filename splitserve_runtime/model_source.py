"""Where a model comes from: `--model` (with `--revision`, `--tokenizer`) resolved to local files.

The launcher, the worker ranks and the frontend all resolve through here, so they agree:

    ""            the default model, SmolLM2-135M-Instruct (default_model.py; fetched once)
    "tiny"        the tiny random-weight Llama for fast tests (tiny_model.py; built once)
    a folder      a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files)
    a .gguf file  a GGUF file: weights, configuration and tokenizer all come from the file
    "org/name"    a Hugging Face Hub id, when no such local path exists: downloaded through
                  huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT,
                  HF_HUB_OFFLINE, `--revision`)

Every failure is a `ModelSourceError` with a one-line message that names what to change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from splitserve_runtime.model_spec import ModelSourceError, model_kind

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What a Hub snapshot needs: configs, safetensors weights, tokenizer files, chat templates.
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model`: `path` is a checkpoint folder, or the .gguf file itself."""

    spec: str
    kind: str  # "default", "tiny", "folder", "gguf" or "hub"
    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights come from: the file itself, or a folder's only weights
        file (the default model's folder: config and tokenizer beside its .gguf)."""
        if self.is_gguf:
            return self.path
        if not self.path.is_dir() or any(self.path.glob("*.safetensors")):
            return None
        files = list(self.path.glob("*.gguf"))
        return files[0] if len(files) == 1 else None


def resolve_model(
    spec: str, revision: str = "", environ: Mapping[str, str] | None = None
) -> ModelSource:
    """The local files of `spec`, fetching or building them on first use."""
    env = os.environ if environ is None else environ
    kind = model_kind(spec)
    if kind == "default":
        from splitserve_runtime.default_model import ensure_default_model

        return ModelSource(spec, kind, ensure_default_model(env))
    if kind == "tiny":
        from splitserve_runtime.tiny_model import ensure_tiny_model

        return ModelSource(spec, kind, ensure_tiny_model(env))
    if kind == "hub":
        return ModelSource(spec, kind, download_from_hub(spec, revision, env))
    path = Path(spec).expanduser()
    if kind == "folder" and not (path / "config.json").exists():
        raise ModelSourceError(f"model folder {spec} has no config.json")
    return ModelSource(spec, kind, path)


def resolve_tokenizer(
    model: ModelSource,
    tokenizer: str = "",
    revision: str = "",
    environ: Mapping[str, str] | None = None,
) -> ModelSource:
    """Where the tokenizer lives: `tokenizer` (resolved like a model; `revision` applies when it
    names the model's own Hub id), else the model itself. Refuses a folder without tokenizer."""
    source = model
    if tokenizer and tokenizer != model.spec:
        kind = model_kind(tokenizer)
        if kind == "folder":  # a tokenizer-only folder needs no config.json
            source = ModelSource(tokenizer, kind, Path(tokenizer).expanduser())
        else:
            source = resolve_model(tokenizer, "", environ)
    elif tokenizer:
        source = resolve_model(tokenizer, revision, environ)
    if not source.is_gguf and not any((source.path / f).exists() for f in TOKENIZER_FILES):
        raise ModelSourceError(
            f"{source.spec or source.path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}"
            f" in {source.path}); pass --tokenizer with a folder, .gguf file or Hub id that has one"
        )
    return source


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """huggingface_hub's cache folder as `environ` sets it (HF_HUB_CACHE, else HF_HOME/hub)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def download_from_hub(repo_id: str, revision: str, environ: Mapping[str, str]) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main), downloaded or cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev = revision or "main"
    cache = hub_cache_dir(environ)
    is_offline = environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    endpoint = environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        folder = snapshot_download(
            repo_id,
            revision=rev,
            cache_dir=str(cache),
            token=environ.get("HF_TOKEN") or None,
            local_files_only=is_offline,
            endpoint=environ.get("HF_ENDPOINT") or None,
            allow_patterns=HUB_FILE_PATTERNS,
        )
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {repo_id!r} has no revision {rev!r} on {endpoint}") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {repo_id!r} not found on {endpoint} (or it is private or gated and HF_TOKEN "
            "does not grant access)"
        ) from None
    except LocalEntryNotFoundError as err:
        if is_offline:
            raise ModelSourceError(
                f"model {repo_id!r} (revision {rev}) is not in the Hugging Face cache {cache} and "
                "HF_HUB_OFFLINE=1 forbids downloading it"
            ) from None
        raise ModelSourceError(
            f"cannot download model {repo_id!r} (revision {rev}) from {endpoint}, and it is not in "
            f"the Hugging Face cache {cache}: {_first_line(err)}"
        ) from None
    except (OSError, ValueError) as err:
        raise ModelSourceError(
            f"cannot download model {repo_id!r} (revision {rev}) from {endpoint}: "
            f"{_first_line(err)}"
        ) from None
    return Path(folder)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
