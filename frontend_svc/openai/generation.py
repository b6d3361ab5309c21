"""What both generation endpoints do with the engine: check the model, build engine requests,
and run them as one stream of (prompt index, delta)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import check_model, engine_error
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.kv_transfer import has_kv_connector
from frontend_svc.openai.chat_output import ChatFeatures
from frontend_svc.openai.fields import DEFAULT_MAX_BODY_BYTES
from frontend_svc.openai.protocol import RequestLimits
from frontend_svc.requests import (
    DEFAULT_MAX_FAN_OUT,
    CompletionDelta,
    EngineRequest,
    GenerateInput,
)
from frontend_svc.serving.classification import ClassifierHead
from frontend_svc.serving.served_models import ServedModels, resolve_model
from splitserve_contracts.output_types import FinishReason

Event = tuple[int, CompletionDelta]
"""(prompt index, delta of one of its completions)."""


@dataclass(frozen=True)
class ServingContext:
    """The engine and facts every route reads; one per frontend, shared with gRPC."""

    engine: AsyncEngine
    inputs: InputProcessor
    info: EngineInfo
    served_model_name: str
    started: float
    max_fan_out: int = DEFAULT_MAX_FAN_OUT
    """--max-fan-out: most engine requests one call may make (prompts x n)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """The largest body, as the gRPC port's largest message (--max-receive-message-bytes)."""
    models: ServedModels | None = None
    """The served model and the engine's LoRA adapters (None: the served model only)."""
    chat: ChatFeatures = ChatFeatures()
    """Tool calling and reasoning (--enable-auto-tool-choice, --tool-call-parser,
    --reasoning-parser)."""
    model_aliases: tuple[str, ...] = ()
    """The other --served-model-name names clients may send (responses carry the first)."""
    classifier: ClassifierHead = ClassifierHead()
    """A sequence classifier's labels and activation (config.json), for /classify."""

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.inputs.limits, self.max_fan_out, has_kv_connector(self.info))

    async def resolve_model(self, requested: str | None) -> str:
        """The LoRA adapter `requested` names ("": the served model); ModelNotFound (404)
        for a name this server does not serve."""
        return await resolve_model(
            self.models, requested, self.served_model_name, self.model_aliases
        )

    def check_model(self, requested: str | None) -> None:
        check_model(requested, self.served_model_name, self.model_aliases)


def request_id(prefix: str, header: str | None, body_id: str | None) -> str:
    """`x-request-id` header, else the body's `request_id`, else a random id."""
    return f"{prefix}-{header or body_id or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def _pump(
    index: int, deltas: AsyncIterator[CompletionDelta], out: asyncio.Queue[Any]
) -> None:
    try:
        async for delta in deltas:
            out.put_nowait((index, delta))
    except Exception as exc:  # handed to the consumer, which raises it
        out.put_nowait(exc)
    finally:
        out.put_nowait(None)


async def prepare(ctx: ServingContext, calls: list[GenerateInput]) -> list[EngineRequest]:
    """Every call validated and tokenized (on the tokenizer threads, off the loop) before any
    runs; a call of several engine requests is admitted whole (--max-inflight-requests)."""
    requests = [await ctx.inputs.run(ctx.inputs.process, call) for call in calls]
    if len(requests) > 1:
        ctx.engine.check_admission(sum(r.params.n for r in requests))
    return requests


async def run(
    ctx: ServingContext, requests: list[EngineRequest], coalesce: bool
) -> AsyncIterator[Event]:
    """Every request's deltas, merged in arrival order. Leaving early (client gone) aborts
    all."""
    arrival = time.monotonic()
    if len(requests) == 1:
        async for delta in ctx.engine.generate(requests[0], arrival, coalesce):
            yield 0, _checked(delta, requests[0])
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_pump(i, ctx.engine.generate(r, arrival, coalesce), queue))
        for i, r in enumerate(requests)
    ]
    try:
        num_open = len(tasks)
        while num_open:
            item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item[0], _checked(item[1], requests[item[0]])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _checked(delta: CompletionDelta, request: EngineRequest) -> CompletionDelta:
    """The delta, unless the engine ended the request: then the error both APIs map it to
    (errors.engine_error: 400 / 429 / 503 by kind, internal detail only in the log)."""
    if delta.finish_reason == FinishReason.ERROR:
        raise engine_error(request.request_id, delta.error_kind, delta.error_message)
    return delta


async def first_and_rest(events: AsyncIterator[Event]) -> tuple[Event | None, AsyncIterator[Event]]:
    """The first event (so refusals such as 429 still get their own status before a stream
    starts) and the iterator that continues after it."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return None, events
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return first, events
