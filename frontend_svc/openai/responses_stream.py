"""The Responses API's stream events for an answer read by chat_output.ChoiceOutput: each output
item (reasoning, message, function_call) is announced (`response.output_item.added`, and its
content part), grows by deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and is closed (`...done`,
`response.output_item.done`), in order, with a rising `sequence_number`, as OpenAI streams
them."""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.openai.responses_protocol import (
    call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
)


class ItemEvents:
    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        """The finished output items, in order."""
        self._open: dict[str, Any] | None = None
        self._text = ""

    def sse(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    @property
    def _index(self) -> int:
        return len(self.items)

    def update(self, fields: dict[str, Any]) -> list[str]:
        """The events for one ChoiceOutput delta."""
        out: list[str] = []
        if fields.get("reasoning"):
            out += self._text_delta("reasoning", fields["reasoning"])
        if fields.get("content"):
            out += self._text_delta("message", fields["content"])
        for call in fields.get("tool_calls") or []:
            out += self._call_delta(call)
        return out

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self._open, self._text = item, ""
        out.append(self.sse("response.output_item.added", output_index=self._index, item=item))
        part = None
        if item["type"] == "message":
            part = output_text("")
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            out.append(self._part_event("response.content_part.added", part))
        return out

    def _part_event(self, kind: str, part: dict[str, Any]) -> str:
        assert self._open is not None
        return self.sse(
            kind, item_id=self._open["id"], output_index=self._index, content_index=0, part=part
        )

    def _text_delta(self, kind: str, delta: str) -> list[str]:
        out: list[str] = []
        if self._open is None or self._open["type"] != kind:
            item = (
                message_item(new_id("msg"), "", "in_progress")
                if kind == "message"
                else reasoning_item(new_id("rs"), "", "in_progress")
            )
            out = self._start(item)
        assert self._open is not None
        self._text += delta
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(
            self.sse(
                event,
                item_id=self._open["id"],
                output_index=self._index,
                content_index=0,
                delta=delta,
                **extra,
            )  # fmt: skip
        )
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        function = call.get("function") or {}
        if "id" in call:
            item = call_item(new_id("fc"), call["id"], function.get("name", ""), "", "in_progress")
            out = self._start(item)
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None and self._open["type"] == "function_call":
            self._text += arguments
            out.append(
                self.sse(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=self._index,
                    delta=arguments,
                )  # fmt: skip
            )
        return out

    def close(self) -> list[str]:
        """Close the open item: its done events, then it joins `items`."""
        item = self._open
        if item is None:
            return []
        self._open = None
        text, index, out = self._text, self._index, []
        if item["type"] == "message":
            done = message_item(item["id"], text)
            out.append(self.sse("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=[]))  # fmt: skip
            out.append(self._done_part(item["id"], index, output_text(text)))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out.append(self.sse("response.reasoning_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text))  # fmt: skip
            out.append(self._done_part(item["id"], index, {"type": "reasoning_text", "text": text}))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            out.append(self.sse("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"], arguments=text))  # fmt: skip
        out.append(self.sse("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return out

    def _done_part(self, item_id: str, index: int, part: dict[str, Any]) -> str:
        return self.sse(
            "response.content_part.done",
            item_id=item_id, output_index=index, content_index=0, part=part,
        )  # fmt: skip
