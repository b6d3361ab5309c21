"""A parser's view of a growing answer turned into what OpenAI streams: content deltas and
`tool_calls` deltas (the first for a call carries its index, id, type and name; later ones
only argument text), and the finished calls for a non-streaming answer."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolCall, ToolParser

_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id(style: str) -> str:
    """vLLM's ids: `chatcmpl-tool-<hex>`; Mistral's templates take only 9 letters/digits."""
    if style == "mistral":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    num_argument_chars: int = 0


@dataclass(slots=True)
class ToolCallStream:
    """What of a parser's output was sent; `update` takes the text new since the last one and
    returns what is new. `max_calls` bounds the calls (1 when parallel_tool_calls is false).

    While only content was found, the content sent is final and is dropped from the text kept:
    marker formats parse only what follows it, and an answer decided to be content (formats
    that must start with their calls) is content to its end. A long answer costs linear time;
    only the calls' own text is parsed again as it grows."""

    parser: ToolParser
    max_calls: int = 1 << 30
    text: str = ""
    """The text not yet committed as content."""
    num_content_chars: int = 0
    """Content sent out of `text`."""
    is_content: bool = False
    sent: list[_Sent] = field(default_factory=list)

    def update(self, new_text: str, is_final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content and tool_calls deltas, given the answer's new text."""
        if self.is_content:
            return new_text, []
        self.text += new_text
        parsed = self.parser.parse(self.text, is_final)
        content = parsed.content[self.num_content_chars :]
        self.num_content_chars = max(self.num_content_chars, len(parsed.content))
        only_content = not parsed.calls and not self.sent and bool(parsed.content)
        if only_content and not self.parser.reads_whole_text:  # harmony keeps all its text
            if self.parser.starts_anywhere:  # committed: no call starts in it
                self.text = self.text[self.num_content_chars :]
                self.num_content_chars = 0
            else:
                self.is_content, self.text = True, ""
        return content, self._call_deltas(parsed)

    def _call_deltas(self, parsed: Parsed) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls[: self.max_calls]):
            if index == len(self.sent):
                if call.name is None:
                    break  # a later call waits for this one's name
                sent = _Sent(new_call_id(self.parser.id_style), call.name)
                self.sent.append(sent)
                deltas.append(
                    {
                        "index": index,
                        "id": sent.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self.sent[index]
            new_arguments = call.arguments[sent.num_argument_chars :]
            if new_arguments:
                sent.num_argument_chars = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new_arguments}})
        return deltas

    def finished_calls(self, drafts: list[CallDraft]) -> list[ToolCall]:
        """The final calls, with the ids streamed for them (new ones otherwise)."""
        calls = []
        for index, draft in enumerate(drafts):
            call_id = (
                self.sent[index].id if index < len(self.sent) else new_call_id(self.parser.id_style)
            )
            calls.append(ToolCall(call_id, draft.name or "", draft.arguments))
        return calls
