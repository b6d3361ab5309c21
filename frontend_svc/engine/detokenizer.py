"""Incremental detokenization: stream text as tokens arrive, never a broken character.

The common path is `tokenizers`' own `DecodeStream` (Rust; about half the per-token cost of
decoding windows from Python, see benchmarks/detokenizer.py). It returns nothing while the text
ends in an incomplete multi-byte character. The windowed decoder below stays for what
DecodeStream cannot serve: tokenizers that are not a `tokenizers.Tokenizer` (a slow HF tokenizer),
the end of an output (`flush` emits what DecodeStream still holds back), and the rest of an output
after DecodeStream gave up ("Invalid prefix encountered", which byte-fallback tokenizers raise
on invalid UTF-8 byte runs).

The windowed decoder decodes only a short window (from the previous read offset) and emits the
part past the already-emitted prefix, holding back while the text ends in U+FFFD. Windows start
where the previous emitted text ended, so decoders that drop a leading space at the start of a
sequence treat every window alike. Both paths emit at the same points, so one request can switch
from DecodeStream to windows at any step; for byte-level BPE tokenizers the concatenation of
everything `step` and `flush` return equals `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def backend_decoder(tokenizer: Any) -> Decoder:
    """The fast (Rust) tokenizer behind an HF tokenizer when there is one: ~0.5 us per window."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer


class IncrementalDetokenizer:
    """Text stream of one growing output; see the module docstring for the invariant."""

    __slots__ = (
        "_decoder",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_skip_special",
        "_stream",
        "_tokenizer",
    )

    def __init__(
        self, decoder: Decoder, skip_special_tokens: bool = True, use_decode_stream: bool = True
    ) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._skip_special = skip_special_tokens
        self._stream: DecodeStream | None = None
        self._tokenizer = decoder if isinstance(decoder, Tokenizer) else None
        if use_decode_stream and self._tokenizer is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def token_ids(self) -> list[int]:
        """Every id given to `step` so far (do not modify)."""
        return self._ids

    def step(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        stream, tokenizer = self._stream, self._tokenizer
        if stream is None or tokenizer is None:
            return self._advance(is_final=False)
        try:  # one id as an int: DecodeStream takes it at half the cost of a list
            text = stream.step(tokenizer, new_ids[0] if len(new_ids) == 1 else new_ids)
        except Exception:  # tokenizers' "Invalid prefix encountered": windows from here on
            self._stream = None
            return self._advance(is_final=False)
        if text is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text

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
