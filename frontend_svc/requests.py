"""Domain types a request passes through in the frontend: prompt in, engine request, deltas out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve_contracts.output_types import ErrorKind, FinishReason
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_runtime.tracing import TraceContext

DEFAULT_MAX_FAN_OUT = 1024
"""Most engine requests one public call may make (--max-fan-out): prompts x n on
/v1/completions, n elsewhere."""
MAX_REQUEST_ID_CHARS = 256
"""The longest request id a client may choose, and the longest the engine core takes."""


def derived_request_id(base: str, suffix: str) -> str:
    """The engine's id for a part of a call (a prompt, a choice): `base` + `suffix`, `base` cut
    so that the whole stays within MAX_REQUEST_ID_CHARS (a client's 256-character id with n > 1
    must not be refused for the suffixes the frontend adds; the client's replies keep its id)."""
    return base[: MAX_REQUEST_ID_CHARS - len(suffix)] + suffix


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image as the client sent it: encoded bytes with their MIME type, or a URL (`data:`,
    or http(s) when the server allows remote media). `where` names the request part, for
    errors."""

    where: str
    data: bytes | None = None
    mime_type: str = ""
    url: str | None = None


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One piece of a chat message: text or an image."""

    text: str | None = None
    image: ImageInput | None = None


@dataclass(frozen=True, slots=True)
class ToolCallInput:
    """A call an earlier assistant turn made (OpenAI's `tool_calls` entry)."""

    id: str
    name: str
    arguments: dict[str, Any]
    """The arguments as an object (chat templates write them with `tojson`)."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str
    parts: tuple[ContentPart, ...] = ()
    """When set, the message is these parts in order and `content` is unused."""
    tool_calls: tuple[ToolCallInput, ...] = ()
    """An assistant turn's calls."""
    tool_call_id: str = ""
    """A `tool` turn: the call it answers."""
    name: str = ""
    reasoning: str = ""
    """An assistant turn's thinking (templates that show it read `reasoning_content`)."""

    def template_fields(self) -> dict[str, Any]:
        """The message's fields besides role and content, as chat templates read them."""
        fields: dict[str, Any] = {}
        if self.tool_calls:
            fields["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            fields["tool_call_id"] = self.tool_call_id
        if self.name:
            fields["name"] = self.name
        if self.reasoning:
            fields["reasoning_content"] = fields["reasoning"] = self.reasoning
        return fields

    @property
    def text(self) -> str:
        """The message's text (its text parts joined by newlines)."""
        if not self.parts:
            return self.content
        return "\n".join(p.text for p in self.parts if p.text is not None)

    @property
    def images(self) -> tuple[ImageInput, ...]:
        return tuple(p.image for p in self.parts if p.image is not None)


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One processed image of a prompt, as the engine gets it: its placeholder range in the
    prompt token ids, its content hash and the encoder input (raw tensor bytes)."""

    modality: str
    identifier: str
    offset: int
    length: int
    data: bytes
    shape: tuple[int, ...]
    dtype: str
    grid_thw: tuple[int, ...] = ()
    """The patch grid (temporal, height, width) of a dynamic-resolution image; empty: none."""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """A prompt as the client sent it: exactly one of text, token_ids or chat is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatTurn, ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Chat: leave the last message open (the model continues it) instead of closing it."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Chat: extra variables for the chat template (e.g. enable_thinking)."""
    tools: tuple[dict[str, Any], ...] | None = None
    """Chat: the tools the model may call, passed to the chat template as
    apply_chat_template(tools=...) takes them."""


@dataclass(frozen=True, slots=True)
class ReasoningTokens:
    """The served reasoning parser's think tokens."""

    start_id: int
    end_id: int
    start: str = "<think>"
    end: str = "</think>"

    def ended_in_text(self, text: str) -> bool:
        """Whether `text` ends the reasoning: its last think marker is the end marker."""
        return text.rfind(self.end) > text.rfind(self.start)

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` (a prompt) end the reasoning: their last think token is the
        end token (vLLM's is_reasoning_end)."""
        for token_id in reversed(token_ids):
            if token_id == self.end_id:
                return True
            if token_id == self.start_id:
                return False
        return False


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A validated-to-be public Generate call."""

    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    structured_outputs: StructuredOutputsParams | None = None
    """The output's grammar (structured outputs); None: free text."""
    structured_outputs_field: str = "structured_outputs"
    """The request field the constraint came from, named in errors."""
    lora_name: str = ""
    """The LoRA adapter to run with, by its name (the request's model); "": the base model."""
    reasoning: ReasoningTokens | None = None
    """The served reasoning parser's tokens (a chat request of a thinking model): with a
    constraint, its grammar starts after the reasoning unless the prompt ended it."""
    kv_transfer_params_json: str = ""
    """vLLM's kv_transfer_params (a JSON object, frontend_svc/kv_transfer.py); "": none."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request ready for the engine core (n = 1; n > 1 is fanned out into several).

    `params` has max_tokens resolved and stop_token_ids completed with the generation
    config's extra EOS ids; `eos_token_id` is None when the request ignores EOS.
    `output_token_ids` are the outputs it already has when it is resubmitted to a restarted
    engine core (which continues after them); `is_resumed` marks such a resubmission (the core
    admitted it once, so its queue limits give it room).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    priority: int = 0
    cache_salt: str = ""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The prompt's images, in placeholder order (empty for a text-only prompt)."""
    output_token_ids: list[int] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    """The output's grammar, checked to compile; the engine core enforces it."""
    is_resumed: bool = False
    lora_name: str = ""
    """The LoRA adapter it runs with ("": the base model)."""
    reasoning_end_token_id: int | None = None
    """With structured_outputs: the token that ends the model's reasoning (the grammar starts
    after it); None: the grammar starts with the first output token."""
    prompt_ends_reasoning: bool = False
    """A thinking model's prompt already closed its thinking (e.g. enable_thinking: false):
    the whole answer is content."""
    trace: TraceContext | None = None
    """The frontend span (llm_request) the engine core's spans hang under; None: not traced."""
    pooling_task: str = ""
    """A pooling request's task ("embed"): the engine pools the prompt and generates nothing;
    "": a generation request."""
    kv_transfer_params_json: str = ""
    """vLLM's kv_transfer_params for the engine's KV connector (a JSON object); "": none."""


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int
    decoded_token: str


@dataclass(slots=True)
class TokenLogprobs:
    chosen: Logprob
    top: list[Logprob]


@dataclass(slots=True)
class CompletionDelta:
    """What is new for one completion (index) since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stop_token_id: int | None = None
    stop_str: str | None = None
    error_message: str = ""
    error_kind: ErrorKind = ErrorKind.UNSPECIFIED
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pooling_output: bytes = b""
    """A pooling request's vector, on its final delta."""
    kv_transfer_params_json: str = ""
    """A KV producer's handoff (vLLM's kv_transfer_params, a JSON object), on its final delta."""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != FinishReason.UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Embedding:
    """One input's embedding (float32) and its prompt length."""

    vector: np.ndarray
    num_prompt_tokens: int
