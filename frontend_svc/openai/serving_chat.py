"""POST /v1/chat/completions: one JSON response, or an SSE stream (after a first chunk per
choice carrying the assistant role, as vLLM and OpenAI send). With a reasoning parser the
thinking comes as `reasoning` (and `reasoning_content`); with tools the calls come as
`tool_calls` (chat_output.py reads both from the answer's text)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from frontend_svc.openai import formatting as fmt
from frontend_svc.openai import generation
from frontend_svc.openai.chat_output import ChoiceOutput, OutputRules, prepare_chat_call
from frontend_svc.openai.formatting import ChoiceState
from frontend_svc.openai.generation import Event, ServingContext
from frontend_svc.openai.protocol import ChatRequest
from frontend_svc.openai.sse import DONE, sse
from frontend_svc.requests import CompletionDelta, GenerateInput, derived_request_id

ROLE = "assistant"


def generate_input(
    ctx: ServingContext, req: ChatRequest, rid: str, lora_name: str = ""
) -> tuple[GenerateInput, OutputRules]:
    """The engine call of a chat request, its tools applied, and the rules of its answers."""
    call = GenerateInput(
        rid,
        req.prompt,
        req.params,
        req.priority,
        req.cache_salt,
        req.structured_outputs,
        req.structured_outputs_field,
        lora_name=lora_name,
        kv_transfer_params_json=req.kv_transfer_params_json,
    )
    return prepare_chat_call(call, req.tools, ctx.chat, req.include_reasoning)


class ChatRun:
    """One /v1/chat/completions call."""

    def __init__(
        self, ctx: ServingContext, req: ChatRequest, rid: str, lora_name: str = ""
    ) -> None:
        self.ctx, self.req, self.rid = ctx, req, rid
        self.lora_name = lora_name
        """The LoRA adapter the request's model names ("": the served model)."""
        self.created = generation.now()
        self.choices = [ChoiceState(i) for i in range(req.params.n)]
        self.outputs: list[ChoiceOutput] = []

    async def events(self, coalesce: bool) -> AsyncIterator[Event]:
        call, rules = generate_input(
            self.ctx, self.req, derived_request_id(self.rid, ""), self.lora_name
        )
        requests = await generation.prepare(self.ctx, [call])
        ended = requests[0].prompt_ends_reasoning
        self.outputs = [ChoiceOutput(rules, ended) for _ in self.choices]
        async for event in generation.run(self.ctx, requests, coalesce):
            yield event

    def _logprobs(self, rows: list[Any]) -> Any:
        return None if self.req.params.logprobs is None else fmt.chat_logprobs(rows)

    def _envelope(self, kind: str, choices: list[Any], usage: Any = None) -> dict[str, Any]:
        model = self.lora_name or self.ctx.served_model_name
        return fmt.envelope(self.rid, kind, self.created, model, choices, usage)

    def usage(self) -> dict[str, Any]:
        first = self.choices[0]
        num_completion = sum(len(c.token_ids) for c in self.choices)
        return fmt.usage(first.num_prompt_tokens, num_completion, first.num_cached_tokens)

    async def response(self) -> dict[str, Any]:
        async for _, delta in self.events(coalesce=True):
            self.choices[delta.index].add(delta)
        bodies = []
        for c, output in zip(self.choices, self.outputs, strict=True):
            message = output.message(c.text)
            bodies.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": output.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        body = self._envelope("chat.completion", bodies, self.usage())
        body["kv_transfer_params"] = self.choices[0].kv_transfer_params  # vLLM's field
        return body

    def _chunk(self, index: int, delta: dict[str, Any], extra: dict[str, Any]) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        usage = None
        options = self.req.stream
        if options is not None and options.include_usage and options.continuous_usage_stats:
            state = self.choices[index]
            usage = fmt.usage(state.num_prompt_tokens, len(state.token_ids), 0)
        return sse(self._envelope("chat.completion.chunk", [choice], usage))

    def _token_chunk(self, delta: CompletionDelta) -> str | None:
        choice = self.choices[delta.index]
        choice.add(delta)
        output = self.outputs[delta.index]
        fields = output.update(delta.text, delta.is_finished)
        if not fields and not delta.is_finished and not delta.logprobs:
            return None  # text held back (a marker may be arriving) or nothing new
        extra = {
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": output.finish_reason(choice.finish_reason)
            if delta.is_finished
            else None,
            "stop_reason": choice.stop_reason if delta.is_finished else None,
        }
        return self._chunk(delta.index, fields, extra)

    async def stream(self, first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[str]:
        options = self.req.stream
        assert options is not None
        for choice in self.choices:
            yield self._chunk(choice.index, {"role": ROLE, "content": ""}, {})
        if first is not None:
            chunk = self._token_chunk(first[1])
            if chunk is not None:
                yield chunk
        async for _, delta in rest:
            chunk = self._token_chunk(delta)
            if chunk is not None:
                yield chunk
        if options.include_usage:
            yield sse(self._envelope("chat.completion.chunk", [], self.usage()))
        yield DONE
