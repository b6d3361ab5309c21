"""/v1/responses (OpenAI's Responses API) over the chat path: create (text, tool calls,
reasoning), streamed as Responses events; `store` keeps the response and its conversation
(response_store.py) for `previous_response_id`, GET /v1/responses/{id}, DELETE and, for
`background: true` responses, POST /v1/responses/{id}/cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from frontend_svc.errors import FrontendError, InvalidRequest
from frontend_svc.openai import generation
from frontend_svc.openai.generation import Event, ServingContext
from frontend_svc.openai.protocol import parse_chat
from frontend_svc.openai.response_store import ResponseStore
from frontend_svc.openai.responses_protocol import (
    ResponsesRequest,
    conversation_tail,
    instructions_message,
    new_id,
    output_items,
    renamed,
)
from frontend_svc.openai.responses_stream import ItemEvents
from frontend_svc.openai.serving_chat import ChatRun
from frontend_svc.openai.sse import error_body

ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "tools", "user")


class ResponsesRun:
    """One /v1/responses call (`open` builds it from the request)."""

    def __init__(
        self,
        ctx: ServingContext,
        store: ResponseStore,
        req: ResponsesRequest,
        rid: str,
        conversation: list[dict[str, Any]],
        chat: ChatRun,
    ) -> None:
        self.ctx, self.store, self.req, self.id = ctx, store, req, rid
        self.created = generation.now()
        self.conversation = conversation
        """The stored conversation of previous_response_id, then this request's messages."""
        self.chat = chat

    @classmethod
    async def open(
        cls, ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, rid: str
    ) -> ResponsesRun:
        """The run of `req` as a chat call; InvalidRequest names the Responses field at fault,
        ModelNotFound (404) a `model` that is neither the served model nor a LoRA adapter."""
        conversation = _history(store, req) + req.new_messages
        chat_body = {**req.chat_body, "messages": instructions_message(req.body) + conversation}
        try:
            chat = parse_chat(
                chat_body,
                ctx.request_limits,
                ctx.inputs.sampling_defaults,
                ctx.chat.can_choose_tools,
            )
        except InvalidRequest as err:
            raise renamed(err) from None
        if chat.params.n != 1:
            raise InvalidRequest("`n` must be 1 on /v1/responses", "n")
        lora_name = await ctx.resolve_model(chat.model)
        return cls(ctx, store, req, rid, conversation, ChatRun(ctx, chat, rid, lora_name))

    def body(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The response object (OpenAI's fields; the request's settings echoed)."""
        req = self.req.body
        chat = self.chat.req
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": self.req.is_background,
            "error": None,
            "incomplete_details": None,
            "model": self.chat.lora_name or self.ctx.served_model_name,
            "output": output,
            "parallel_tool_calls": chat.tools.is_parallel if chat.tools is not None else True,
            "previous_response_id": self.req.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(req.get("reasoning") or {})},
            "store": self.req.is_stored,
            "text": req.get("text") or {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto" if req.get("tools") else "none"),
            "truncation": req.get("truncation") or "disabled",
            "usage": None,
            **{name: req.get(name) for name in ECHOED},
        }
        body["tools"] = body["tools"] or []
        body["metadata"] = body["metadata"] or {}
        body.update(extra)
        return body

    def _usage(self) -> dict[str, Any]:
        usage = self.chat.usage()
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }

    def finished(self, output: list[dict[str, Any]], finish_reason: str | None) -> dict[str, Any]:
        """The final response object, stored when `store` is on."""
        extra: dict[str, Any] = {"usage": self._usage()}
        status = "completed"
        if finish_reason == "length":
            status, extra["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        body = self.body(status, output, **extra)
        self.save(body, output)
        return body

    def save(self, body: dict[str, Any], output: list[dict[str, Any]]) -> None:
        if self.req.is_stored:
            self.store.put(body, self.conversation + conversation_tail(output))

    async def response(self) -> dict[str, Any]:
        chat = await self.chat.response()
        choice = chat["choices"][0]
        return self.finished(output_items(choice["message"]), choice["finish_reason"])

    async def stream(self, first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[str]:
        """Responses events: created, in_progress, each item's added / deltas / done, then
        completed (or incomplete); a failure ends the stream with an `error` event."""
        events = ItemEvents()
        yield events.sse("response.created", response=self.body("in_progress", []))
        yield events.sse("response.in_progress", response=self.body("in_progress", []))
        output = self.chat.outputs[0]
        state = self.chat.choices[0]
        try:
            pending = [first] if first is not None else []
            async for _, delta in _chain(pending, rest):
                state.add(delta)
                for chunk in events.update(output.update(delta.text, delta.is_finished)):
                    yield chunk
            for chunk in events.close():
                yield chunk
        except FrontendError as err:
            yield events.sse("error", **_stream_error(err))
            return
        body = self.finished(events.items, output.finish_reason(state.finish_reason))
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield events.sse(kind, response=body)


def _history(store: ResponseStore, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The stored conversation `previous_response_id` continues ([] without one)."""
    if req.previous_response_id is None:
        return []
    previous = store.get(req.previous_response_id)
    if previous is None:
        raise InvalidRequest(
            f"Previous response with id {req.previous_response_id!r} not found (it was not "
            "stored, expired, or another frontend holds it)",
            "previous_response_id",
        )
    return list(previous.conversation)


async def _chain(first: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event


def _stream_error(err: FrontendError) -> dict[str, Any]:
    error = error_body(err)["error"]
    return {"code": str(error["code"]), "message": error["message"], "param": error["param"]}


async def run_in_background(run: ResponsesRun) -> dict[str, Any]:
    """Start a `background: true` response: stored in_progress at once, completed (or
    failed, or cancelled) by a task that outlives the HTTP call."""
    queued = run.body("in_progress", [])
    entry = run.store.put(queued, run.conversation)

    async def work() -> None:
        try:
            await run.response()
        except asyncio.CancelledError:
            run.store.put(run.body("cancelled", []), run.conversation)
            raise
        except FrontendError as err:
            failed = run.body("failed", [], error={"code": "server_error", "message": str(err)})
            run.store.put(failed, run.conversation)

    entry.task = asyncio.create_task(work(), name=f"response-{run.id}")
    return queued


async def cancel(store: ResponseStore, response_id: str) -> dict[str, Any]:
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    if not entry.body.get("background"):
        raise InvalidRequest("Only responses created with background=true can be cancelled.")
    task = entry.task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    current = store.get(response_id)
    return current.body if current is not None else entry.body


def not_found(response_id: str) -> InvalidRequest:
    err = InvalidRequest(f"Response with id {response_id!r} not found.", "response_id")
    err.http_status, err.error_type = 404, "not_found_error"
    return err


def new_response_id() -> str:
    return new_id("resp")
