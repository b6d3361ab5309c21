"""The OpenAI-compatible HTTP API as a Starlette app over the frontend's own engine.

Every route goes through `_route`, which authenticates every route but the probes and /metrics
(on the routed endpoint, not on a rebuilt URL), turns FrontendError into OpenAI's error JSON with
its HTTP status (429 adds Retry-After; server-side detail only in the log, under an error id) and
anything unexpected into a 500 with an error id (its traceback logged at most once per route per
interval), so no request body can take the server down or flood its log. A non-streaming call
whose client disconnects is cancelled, which aborts it in the core; a stream is cancelled by
Starlette when its client goes away. Every other request is counted in vLLM's HTTP metrics
(prometheus-fastapi-instrumentator, as vLLM does).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from frontend_svc.auth.api_key import check_api_key
from frontend_svc.errors import FrontendError, InvalidRequest, Overloaded
from frontend_svc.openai import admin
from frontend_svc.openai.fields import read_json
from frontend_svc.openai.generation import ServingContext, first_and_rest, request_id
from frontend_svc.openai.ops_routes import NO_OPS, OpsOptions, ServerLoad, ops_routes
from frontend_svc.openai.protocol import as_client_id, parse_chat, parse_completion
from frontend_svc.openai.response_store import ResponseStore
from frontend_svc.openai.responses_protocol import parse_responses
from frontend_svc.openai.serving_chat import ChatRun
from frontend_svc.openai.serving_classify import create_classify, create_pooling
from frontend_svc.openai.serving_completion import CompletionRun
from frontend_svc.openai.serving_embedding import create_embeddings
from frontend_svc.openai.serving_responses import (
    ResponsesRun,
    cancel,
    new_response_id,
    not_found,
    run_in_background,
)
from frontend_svc.openai.serving_score import create_rerank, create_scores
from frontend_svc.openai.sse import error_body, guarded
from frontend_svc.public_errors import unexpected_error_message
from frontend_svc.serving.pooling import check_generative
from frontend_svc.tracing import set_caller_trace

CLASSIC_TEXT = "text/plain; version=0.0.4; charset=utf-8"
Handler = Callable[[Request], Awaitable[Response]]
UNMEASURED_PATHS = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]
"""Probes and scrapes, left out of the HTTP request metrics (vLLM leaves out the same)."""


class JsonResponse(JSONResponse):
    """A JSON reply rendered by msgspec (compact UTF-8, several times faster than Starlette's
    json.dumps for a completion body; nothing here holds NaN or Infinity: logprobs are
    clamped, formatting.MIN_LOGPROB)."""

    def render(self, content: Any) -> bytes:
        return _encode(content)


_encode = msgspec.json.Encoder().encode


def error_response(err: FrontendError, message: str | None = None) -> JSONResponse:
    headers = {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return JsonResponse(error_body(err, message), status_code=err.http_status, headers=headers)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; if the client disconnects first, `work` is cancelled (which aborts its
    engine requests) and CancelledError propagates."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return task.result()


def _sse_response(chunks: Any, rid: str) -> StreamingResponse:
    headers = {"x-request-id": rid, "cache-control": "no-cache"}
    return StreamingResponse(guarded(chunks), media_type="text/event-stream", headers=headers)


def _make_generate(ctx: ServingContext, kind: str) -> Handler:
    async def handle(request: Request) -> Response:
        set_caller_trace(request.headers)  # the client's traceparent, for this request's spans
        body = await read_json(request, ctx.max_body_bytes)
        limits, defaults = ctx.request_limits, ctx.inputs.sampling_defaults
        header_id = request.headers.get("x-request-id")
        if header_id is not None:
            as_client_id(header_id, "the x-request-id header")
        check_generative(ctx.info, "Chat Completions API" if kind == "chat" else "Completions API")
        run: CompletionRun | ChatRun
        if kind == "chat":
            req = parse_chat(body, limits, defaults, ctx.chat.can_choose_tools)
            lora = await ctx.resolve_model(req.model)
            run = ChatRun(ctx, req, request_id("chatcmpl", header_id, req.request_id), lora)
        else:
            creq = parse_completion(body, limits, defaults)
            lora = await ctx.resolve_model(creq.model)
            run = CompletionRun(ctx, creq, request_id("cmpl", header_id, creq.request_id), lora)
        rid = run.rid
        if run.req.stream is None:
            result = await unless_disconnected(request, run.response())
            return JsonResponse(result, headers={"x-request-id": rid})
        first, rest = await first_and_rest(run.events(coalesce=False))
        return _sse_response(run.stream(first, rest), rid)

    return handle


POOLING_ROUTES = (
    ("/v1/embeddings", create_embeddings),
    ("/score", create_scores),
    ("/v1/score", create_scores),
    ("/rerank", create_rerank),
    ("/v1/rerank", create_rerank),
    ("/v2/rerank", create_rerank),
    ("/classify", create_classify),
    ("/pooling", create_pooling),
)
"""vLLM's pooling routes and their aliases."""


PoolingCreate = Callable[[ServingContext, dict[str, Any], str | None], Awaitable[dict[str, Any]]]
"""A pooling route's work: (context, body, x-request-id header) -> the reply."""


def _make_pooling(ctx: ServingContext, create: PoolingCreate) -> Handler:
    """A pooling route: /v1/embeddings, /score, /rerank, /classify, /pooling
    (`create(ctx, body, header_id)`)."""

    async def handle(request: Request) -> Response:
        body = await read_json(request, ctx.max_body_bytes)
        work = create(ctx, body, request.headers.get("x-request-id"))
        reply = await unless_disconnected(request, work)
        return JsonResponse(reply, headers={"x-request-id": reply["id"]})

    return handle


def _responses_routes(
    ctx: ServingContext, store: ResponseStore
) -> list[tuple[str, list[str], Handler]]:
    """/v1/responses: create, retrieve, delete, cancel (serving_responses.py)."""

    async def create(request: Request) -> Response:
        body = await read_json(request, ctx.max_body_bytes)
        check_generative(ctx.info, "Responses API")
        req = parse_responses(body)
        run = await ResponsesRun.open(ctx, store, req, new_response_id())
        if req.is_background:
            return JSONResponse(await run_in_background(run))
        if not req.is_stream:
            return JSONResponse(await unless_disconnected(request, run.response()))
        first, rest = await first_and_rest(run.chat.events(coalesce=False))
        return _sse_response(run.stream(first, rest), run.id)

    def stored(request: Request) -> tuple[str, Any]:
        response_id = request.path_params["response_id"]
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return response_id, entry

    async def retrieve(request: Request) -> Response:
        return JSONResponse(stored(request)[1].body)

    async def delete(request: Request) -> Response:
        response_id, entry = stored(request)
        if entry.task is not None:
            entry.task.cancel()
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel_route(request: Request) -> Response:
        return JSONResponse(await cancel(store, request.path_params["response_id"]))

    return [
        ("/v1/responses", ["POST"], create),
        ("/v1/responses/{response_id}", ["GET"], retrieve),
        ("/v1/responses/{response_id}", ["DELETE"], delete),
        ("/v1/responses/{response_id}/cancel", ["POST"], cancel_route),
    ]


def _route(handler: Handler, api_key: str, is_protected: bool) -> Handler:
    async def guarded_handler(request: Request) -> Response:
        try:
            if is_protected:
                check_api_key(request.headers.get("authorization"), api_key)
            return await handler(request)
        except FrontendError as err:
            return error_response(err)
        except asyncio.CancelledError:
            raise
        except ClientDisconnect:  # gone mid-body, or cut off by --http-body-timeout: no one to tell
            return Response(status_code=400)
        except Exception:
            message = unexpected_error_message(f"{request.method} {request.url.path}")
            return error_response(FrontendError(), message)

    return guarded_handler


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown route (404) or method (405), in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    err = InvalidRequest(f"{request.method} {request.url.path}: {exc.detail}")
    err.http_status = exc.status_code
    if exc.status_code == 404:
        err.error_type = "not_found_error"
    return error_response(err)


def build_app(
    ctx: ServingContext,
    registry: CollectorRegistry,
    api_key: str = "",
    store: ResponseStore | None = None,
    engine_series: Callable[[], Awaitable[bytes]] | None = None,
    ops: OpsOptions = NO_OPS,
) -> Starlette:
    """The app: /v1/* and the tokenizer routes (behind `api_key` when set), health, version and
    metrics (open, as vLLM's). /metrics adds `engine_series` (the engine core's, for gateways
    scraping the serving port: frontend_svc/engine/engine_stats.py) to the frontend's own."""

    async def metrics(request: Request) -> Response:
        text = generate_latest(registry)
        if engine_series is not None:
            text += await engine_series()
        return Response(text, media_type=CLASSIC_TEXT)

    load = ServerLoad(ops.track_load)
    completions, chat = _make_generate(ctx, "completions"), _make_generate(ctx, "chat")
    table: list[tuple[str, list[str], Handler, bool]] = [
        ("/v1/completions", ["POST"], functools.partial(load.track, completions), True),
        ("/v1/chat/completions", ["POST"], functools.partial(load.track, chat), True),
        *(
            (path, ["POST"], functools.partial(load.track, _make_pooling(ctx, create)), True)
            for path, create in POOLING_ROUTES
        ),
        ("/v1/models", ["GET"], admin.models_route(ctx), True),
        ("/v1/load_lora_adapter", ["POST"], admin.load_lora_route(ctx), True),
        ("/v1/unload_lora_adapter", ["POST"], admin.unload_lora_route(ctx), True),
        ("/health", ["GET"], admin.health_route(ctx), False),
        ("/ping", ["GET", "POST"], admin.health_route(ctx), False),
        ("/version", ["GET"], admin.version, False),
        ("/tokenize", ["POST"], admin.tokenize_route(ctx), True),
        ("/detokenize", ["POST"], admin.detokenize_route(ctx), True),
        ("/metrics", ["GET"], metrics, False),
        *ops_routes(ctx, ops, load),
    ]
    responses = _responses_routes(ctx, store if store is not None else ResponseStore())
    table += [(path, methods, handler, True) for path, methods, handler in responses]
    routes = [
        Route(path, _route(handler, api_key, protected), methods=methods)
        for path, methods, handler, protected in table
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    # vLLM's HTTP metrics: http_requests_total{handler,method,status="2xx|4xx|5xx"} and the
    # http_request_duration_seconds / _size_bytes histograms, on the same registry.
    Instrumentator(excluded_handlers=UNMEASURED_PATHS, registry=registry).instrument(app)
    return app
