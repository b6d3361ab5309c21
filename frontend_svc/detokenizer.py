"""Incremental detokenization: stream text as tokens arrive, never a broken character.

The concatenation of everything `step` and `flush` return equals `tokenizer.decode(all ids)`: each
step decodes only a short window (from the previous read offset) and emits the part past the
already-emitted prefix, holding back while the text ends in U+FFFD (an incomplete multi-byte
character). Windows start where the previous emitted text ended, so decoders that drop a leading
space at the start of a sequence treat every window alike.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def backend_decoder(tokenizer: Any) -> Decoder:
    """The fast (Rust) tokenizer behind an HF tokenizer when there is one: ~0.5 us per window."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer


class IncrementalDetokenizer:
    """Text stream of one growing output; see the module docstring for the invariant."""

    __slots__ = ("_decoder", "_ids", "_prefix_offset", "_read_offset", "_skip_special")

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._skip_special = skip_special_tokens

    @property
    def token_ids(self) -> list[int]:
        """Every id given to `step` so far (do not modify)."""
        return self._ids

    def step(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Return whatever is still held back (the output is over)."""
        return self._advance(is_final=True)

    def _advance(self, is_final: bool) -> str:
        ids, skip = self._ids, self._skip_special
        if self._read_offset == len(ids):
            return ""
        prefix = self._decoder.decode(ids[self._prefix_offset : self._read_offset], skip)
        text = self._decoder.decode(ids[self._prefix_offset :], skip)
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT_CHAR) and not is_final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return text[len(prefix) :]
