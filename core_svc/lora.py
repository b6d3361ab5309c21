"""LoRA adapters in the engine core: the names requests use, the ids the workers know.

The engine core owns the adapter registry (vLLM's OpenAIServingModels' lora_requests, one per
engine instead of one per API server, so every frontend sees the same adapters): `--lora-modules`
at start-up and LoadLoraAdapter at runtime give a name a fresh integer id and a folder on the
worker ranks, which each rank reads once (WorkerService.LoadLoraAdapter). Requests name their
adapter; the servicer resolves the name to a `LoraRequest` when it converts the request, so a
name unloaded afterwards does not affect requests already added. Ids are never reused: a name
loaded again (or in place) gets a new id, and the old id's cached KV blocks, hashed with it, are
never hit again.

The registry is used on the servicer's event loop only.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePosixPath

MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """The adapter a request runs with (vLLM's LoRARequest); lora_id 0: its name is not
    loaded (the request is refused when it is added)."""

    lora_id: int
    name: str
    path: str

    @property
    def hash_key(self) -> bytes:
        """What every block hash of its requests includes (block_hash.py): the id (never
        reused) and the name, tagged and length-prefixed."""
        name = self.name.encode()
        return struct.pack("<4sII", b"lora", self.lora_id, len(name)) + name


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One --lora-modules entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str = ""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter, as ListLoraAdapters reports it."""

    name: str
    path: str
    base_model_name: str
    lora_id: int
    max_rank: int

    @property
    def request(self) -> LoraRequest:
        return LoraRequest(self.lora_id, self.name, self.path)


LORA_OFF = "LoRA is off: start the engine with --enable-lora"


class LoraErrorKind(Enum):
    INVALID = 1
    EXISTS = 2
    NOT_FOUND = 3
    OFF = 4
    UNAVAILABLE = 5


class LoraError(Exception):
    """Why a load or unload is refused; `kind` picks the status."""

    def __init__(self, kind: LoraErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def lora_module(text: str) -> LoraModule:
    """argparse type of --lora-modules: `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`; a relative path is taken from the
    engine core's working directory (the ranks get it absolute)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
        if not isinstance(value, dict) or set(value) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                'expected {"name": ..., "path": ..., "base_model_name": ...}'
            )
        module = LoraModule(
            str(value.get("name", "")),
            str(value.get("path", "")),
            str(value.get("base_model_name") or ""),
        )
    else:
        name, eq, path = text.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
        module = LoraModule(name.strip(), path.strip())
    if module.path and not module.path.startswith("/"):  # relative to the core's folder
        module = LoraModule(module.name, os.path.abspath(module.path), module.base_model_name)
    try:
        check_lora_fields(module.name, module.path)
    except LoraError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return module


def check_lora_fields(name: str, path: str) -> None:
    """A name and a path the registry accepts (the ranks check the folder's contents)."""
    invalid = LoraErrorKind.INVALID
    if not name or not path:
        raise LoraError(invalid, "Both 'lora_name' and 'lora_path' must be provided.")
    if len(name) > MAX_LORA_NAME_CHARS or not name.isprintable():
        raise LoraError(
            invalid,
            f"lora_name must be at most {MAX_LORA_NAME_CHARS} printable characters",
        )
    pure = PurePosixPath(path)
    if len(path) > MAX_LORA_PATH_CHARS or not path.isprintable():
        raise LoraError(invalid, f"lora_path must be at most {MAX_LORA_PATH_CHARS} characters")
    if not pure.is_absolute() or ".." in pure.parts:
        raise LoraError(
            invalid,
            f"lora_path {path!r} must be an absolute path without '..': the adapter's folder on "
            "the worker ranks",
        )


class LoraRegistry:
    """Loaded adapters by name; see the module docstring."""

    def __init__(self, is_enabled: bool, served_model_name: str) -> None:
        self.is_enabled = is_enabled
        """The engine serves adapters (--enable-lora); else every load is refused."""
        self.served_model_name = served_model_name
        self.adapters: dict[str, LoraAdapter] = {}
        self._loading: set[str] = set()
        self._next_id = 1

    def lookup(self, name: str) -> LoraRequest | None:
        """The adapter a request names (None: the base model; lora_id 0: not loaded)."""
        if not name or name == self.served_model_name:
            return None
        adapter = self.adapters.get(name)
        return LoraRequest(0, name, "") if adapter is None else adapter.request

    def reserve(self, name: str, path: str, load_inplace: bool) -> int:
        """Hold `name` while its files load on the ranks; returns the new adapter's id."""
        if not self.is_enabled:
            raise LoraError(LoraErrorKind.OFF, LORA_OFF)
        check_lora_fields(name, path)
        if name == self.served_model_name:
            raise LoraError(
                LoraErrorKind.INVALID,
                f"The lora adapter '{name}' conflicts with a served base model.",
            )
        if name in self._loading:
            raise LoraError(LoraErrorKind.EXISTS, f"The lora adapter '{name}' is being loaded.")
        if name in self.adapters and not load_inplace:
            raise LoraError(
                LoraErrorKind.EXISTS,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        self._loading.add(name)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def release(self, name: str) -> None:
        """The load failed: the name is free again."""
        self._loading.discard(name)

    def commit(self, adapter: LoraAdapter) -> LoraAdapter | None:
        """The ranks hold the adapter: requests may name it. Returns the adapter it replaced
        (a load in place), whose requests finish with it."""
        self._loading.discard(adapter.name)
        previous = self.adapters.pop(adapter.name, None)
        self.adapters[adapter.name] = adapter
        return previous

    def remove(self, name: str) -> LoraAdapter:
        """Forget `name` (NOT_FOUND when it is not loaded)."""
        if not name:
            raise LoraError(
                LoraErrorKind.INVALID, "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(LoraErrorKind.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
        return adapter
