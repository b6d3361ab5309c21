"""The tokenizer a gateway needs to tokenize for this model (GetTokenizer): the files of the
tokenizer the frontend itself loaded, as a zip archive in the chunks smg-grpc-proto defines.

The archive is smg-grpc-servicer's (`TokenizerBundle`: the file names the gateway's tokenizer
loader looks for, built once off the event loop, then served from memory). A tokenizer read
out of a .gguf file has no files of its own: it is saved once with `save_pretrained` into a
private temporary folder and that folder is archived.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

from smg_grpc_servicer.tokenizer_bundle import TokenizerBundle

logger = logging.getLogger(__name__)


class TokenizerFiles:
    """The served model's tokenizer files, archived on first use."""

    def __init__(self, tokenizer: Any, tokenizer_folder: Path | None) -> None:
        self._tokenizer = tokenizer
        self._folder = tokenizer_folder
        self._bundle: TokenizerBundle | None = None
        self._saved: tempfile.TemporaryDirectory[str] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        """The zip archive's bytes and their SHA-256 hex digest."""
        async with self._lock:
            if self._bundle is None:
                folder = self._folder or await asyncio.to_thread(self._save)
                self._bundle = TokenizerBundle(folder)
        data, sha256 = await self._bundle.archive()
        return data, sha256

    def _save(self) -> Path:
        self._saved = tempfile.TemporaryDirectory(prefix="splitserve-tokenizer-")
        self._tokenizer.save_pretrained(self._saved.name)
        logger.info("saved the tokenizer (read from a .gguf file) for GetTokenizer")
        return Path(self._saved.name)
