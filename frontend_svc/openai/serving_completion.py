"""POST /v1/completions: one JSON response, or an SSE stream of one token per chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from frontend_svc.openai import formatting as fmt
from frontend_svc.openai import generation
from frontend_svc.openai.formatting import ChoiceState
from frontend_svc.openai.generation import Event, ServingContext
from frontend_svc.openai.protocol import CompletionRequest
from frontend_svc.openai.sse import DONE, sse
from frontend_svc.requests import GenerateInput, Logprob, TokenLogprobs, derived_request_id


def _calls(req: CompletionRequest, rid: str, lora_name: str) -> list[GenerateInput]:
    return [
        GenerateInput(
            derived_request_id(rid, f"-{i}"),
            prompt,
            req.params,
            req.priority,
            req.cache_salt,
            req.structured_outputs,
            req.structured_outputs_field,
            lora_name=lora_name,
            kv_transfer_params_json=req.kv_transfer_params_json,
        )
        for i, prompt in enumerate(req.prompts)
    ]


class _Echo:
    """Prompt text and prompt logprobs, for `echo`; the prompts' token ids are the engine
    requests' (tokenized off the event loop)."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        self.texts = [p.text or "" for p in req.prompts]
        self.ids: list[list[int]] = [[] for _ in req.prompts]

    def text(self, prompt_index: int) -> str:
        ids = self.ids[prompt_index]
        text = self.texts[prompt_index]
        return text if text else self.ctx.tokenizer.decode(ids)

    def logprob_rows(
        self, prompt_index: int, rows: list[TokenLogprobs]
    ) -> list[TokenLogprobs | Logprob]:
        first_id = self.ids[prompt_index][0]
        first = Logprob(first_id, 0.0, 0, self.ctx.tokenizer.decode([first_id]))
        return [first, *rows]


class CompletionRun:
    """One /v1/completions call: its choices' state and how to print them."""

    def __init__(
        self, ctx: ServingContext, req: CompletionRequest, rid: str, lora_name: str = ""
    ) -> None:
        self.ctx, self.req, self.rid = ctx, req, rid
        self.lora_name = lora_name
        """The LoRA adapter the request's model names ("": the served model)."""
        self.n = req.params.n
        self.created = generation.now()
        self.choices = [ChoiceState(i) for i in range(len(req.prompts) * self.n)]
        self.echo = _Echo(ctx, req) if req.echo else None
        self.offsets = [0] * len(self.choices)
        self.has_started = [False] * len(self.choices)

    async def events(self, coalesce: bool) -> AsyncIterator[Event]:
        requests = await generation.prepare(self.ctx, _calls(self.req, self.rid, self.lora_name))
        if self.echo is not None:
            self.echo.ids = [list(r.prompt_token_ids) for r in requests]
        async for event in generation.run(self.ctx, requests, coalesce):
            yield event

    def _piece(self, choice: ChoiceState, prompt_index: int, text: str, rows: list[Any]) -> Any:
        """(text, logprobs) of a choice's next piece, the echoed prompt before its first."""
        i = choice.index
        if self.echo is not None and not self.has_started[i]:
            text = self.echo.text(prompt_index) + text
            if self.req.params.logprobs is not None:
                rows = [*self.echo.logprob_rows(prompt_index, choice.prompt_logprobs), *rows]
        self.has_started[i] = True
        if self.req.params.logprobs is None:
            return text, None
        logprobs, self.offsets[i] = fmt.completion_logprobs(rows, self.offsets[i])
        return text, logprobs

    def _choice_body(self, choice: ChoiceState, text: str, logprobs: Any) -> dict[str, Any]:
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.req.params.prompt_logprobs is not None and choice.prompt_logprobs:
            body["prompt_logprobs"] = fmt.prompt_logprobs(choice.prompt_logprobs)
        return body

    def _envelope(self, choices: list[Any], usage: Any = None) -> dict[str, Any]:
        model = self.lora_name or self.ctx.served_model_name
        return fmt.envelope(self.rid, "text_completion", self.created, model, choices, usage)

    def usage(self) -> dict[str, Any]:
        firsts = self.choices[:: self.n]  # the prompt counts once per prompt, not per choice
        return fmt.usage(
            sum(c.num_prompt_tokens for c in firsts),
            sum(len(c.token_ids) for c in self.choices),
            sum(c.num_cached_tokens for c in firsts),
        )

    async def response(self) -> dict[str, Any]:
        async for prompt_index, delta in self.events(coalesce=True):
            self.choices[prompt_index * self.n + delta.index].add(delta)
        bodies = []
        for c in self.choices:
            text, logprobs = self._piece(c, c.index // self.n, c.text, c.logprobs)
            bodies.append(self._choice_body(c, text, logprobs))
        body = self._envelope(bodies, self.usage())
        body["kv_transfer_params"] = self.choices[0].kv_transfer_params  # vLLM's field
        return body

    async def stream(self, first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[str]:
        """SSE: a chunk per delta (one token each), then the usage chunk if asked, then
        [DONE]."""
        options = self.req.stream
        assert options is not None
        events = rest if first is None else _prepend(first, rest)
        async for prompt_index, delta in events:
            choice = self.choices[prompt_index * self.n + delta.index]
            choice.add(delta)
            text, logprobs = self._piece(choice, prompt_index, delta.text, delta.logprobs)
            usage = None
            if options.include_usage and options.continuous_usage_stats:
                usage = fmt.usage(choice.num_prompt_tokens, len(choice.token_ids), 0)
            yield sse(self._envelope([self._choice_body(choice, text, logprobs)], usage))
        if options.include_usage:
            yield sse(self._envelope([], self.usage()))
        yield DONE


async def _prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event
