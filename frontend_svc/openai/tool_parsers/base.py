"""What every tool-call parser returns, and the rule that makes streaming safe.

A parser reads the text a model generated so far and says which part of it is content (shown
to the client as text) and which tool calls it holds. It is a pure function of the text:
`parse(text, is_final)`. Each parser keeps one promise, checked by property tests for every
format: for text `t` and any prefix `p` of it, `parse(p)` is a prefix of `parse(t)` — its
content a prefix of the content, its calls the first calls with the same names (or names not
known yet) and arguments that are prefixes of the final arguments. Streaming then only sends
what is new since the last parse (stream.py), and the deltas add up to the non-streaming
answer however the text was cut into chunks.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class CallDraft:
    """One tool call as far as the text goes."""

    name: str | None
    """None until the whole name was generated."""
    arguments: str
    """The arguments' JSON text so far (a prefix of the final text)."""
    is_complete: bool = False


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str
    """Text for the client: what is certainly not part of a tool call."""
    calls: tuple[CallDraft, ...] = ()


@dataclass(slots=True)
class ToolCall:
    """A finished call, as the response carries it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


ToolSchemas = Mapping[str, Mapping[str, Any]]
"""Tool name -> its parameters' JSON Schema (for formats that need argument types)."""


class ToolParser(ABC):
    """A model family's tool-call format (vLLM's ToolParser, by the same names)."""

    markers: ClassVar[tuple[str, ...]] = ()
    """Texts that start or frame calls; when a tokenizer makes one a special token, the
    request keeps special tokens in its text (vLLM's adjust_request)."""
    id_style: ClassVar[str] = "openai"
    starts_anywhere: ClassVar[bool] = True
    """Calls may follow content (they start at a marker); False: the whole answer is either
    content or calls, decided by how it starts."""
    reads_whole_text: ClassVar[bool] = False
    """The format frames the whole answer (harmony): the parser reads the answer's own text,
    not what a reasoning parser left of it, and the stream keeps all of it."""

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self.tools: ToolSchemas = tools or {}

    @abstractmethod
    def parse(self, text: str, is_final: bool) -> Parsed:
        """Content and calls of `text`; `is_final`: the text is complete."""

    def extract(self, text: str) -> tuple[str, list[CallDraft]]:
        """The final answer's content and calls (vLLM's extract_tool_calls): when a call is
        malformed — unfinished, no name, arguments that are not a JSON object — the whole text
        is content and there are no calls, as vLLM answers."""
        parsed = self.parse(text, is_final=True)
        if not parsed.calls:
            return parsed.content, []
        if not all(
            call.is_complete and call.name and _is_object(call.arguments) for call in parsed.calls
        ):
            return text, []
        return parsed.content, list(parsed.calls)


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def partial_overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (text that may
    still become the marker, held back while streaming)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def held_back(text: str, markers: Sequence[str], is_final: bool) -> str:
    """`text` less an end that could still become one of `markers`."""
    if is_final:
        return text
    cut = max((partial_overlap(text, m) for m in markers), default=0)
    return text[: len(text) - cut]


def dumps(value: Any) -> str:
    """JSON text as vLLM writes arguments (json.dumps, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)
