"""The small routes: /v1/models, /health and /ping, /version, /tokenize, /detokenize
(vLLM's shapes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from frontend_svc.errors import EngineUnavailable, InvalidRequest, NotEnabled
from frontend_svc.openai.fields import (
    as_bool,
    as_int_tuple,
    as_list,
    as_object,
    as_str,
    read_json,
)
from frontend_svc.openai.fields import read as read_field
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.protocol import chat_turns
from frontend_svc.requests import PromptInput
from frontend_svc.serving.served_models import ServedModels

Handler = Callable[[Request], Awaitable[Response]]


def _card(ctx: ServingContext, name: str, root: str, parent: str | None) -> dict[str, object]:
    """vLLM's ModelCard (an adapter's has its parent and no max_model_len of its own)."""
    return {
        "id": name,
        "object": "model",
        "created": int(ctx.started),
        "owned_by": "splitserve",
        "root": root,
        "parent": parent,
        "max_model_len": ctx.info.max_model_len if parent is None else None,
        "permission": [],
    }


def models_route(ctx: ServingContext) -> Handler:
    async def models(request: Request) -> Response:
        """One card per --served-model-name (as vLLM lists its base model's names), then every
        LoRA adapter with its parent (vLLM's /v1/models)."""
        cards = [
            _card(ctx, name, ctx.info.options.model.model, None)
            for name in (ctx.served_model_name, *ctx.model_aliases)
        ]
        if ctx.models is not None:
            await ctx.models.refresh()
            cards += [
                _card(ctx, a.name, a.path, a.base_model_name or ctx.served_model_name)
                for a in ctx.models.adapters.values()
            ]
        return JSONResponse({"object": "list", "data": cards})

    return models


def _served_models(ctx: ServingContext) -> ServedModels:
    if ctx.models is None:
        raise NotEnabled("this server serves no LoRA adapters")
    return ctx.models


def load_lora_route(ctx: ServingContext) -> Handler:
    async def load_lora(request: Request) -> Response:
        """vLLM's /v1/load_lora_adapter: 200 with a plain-text success line."""
        body = await read_json(request, ctx.max_body_bytes)
        name = read_field(body, "lora_name", as_str, "")
        path = read_field(body, "lora_path", as_str, "")
        inplace = read_field(body, "load_inplace", as_bool, False)
        await _served_models(ctx).load(name, path, inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    return load_lora


def unload_lora_route(ctx: ServingContext) -> Handler:
    async def unload_lora(request: Request) -> Response:
        """vLLM's /v1/unload_lora_adapter: requests already running the adapter finish
        with it; later ones naming it get 404."""
        body = await read_json(request, ctx.max_body_bytes)
        name = read_field(body, "lora_name", as_str, "")
        await _served_models(ctx).unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return unload_lora


def health_route(ctx: ServingContext) -> Handler:
    async def health(request: Request) -> Response:
        """200 with an empty body only while the engine core can serve (vLLM's /health)."""
        if not ctx.engine.is_ready:
            raise EngineUnavailable("the engine core is not reachable; not ready to serve")
        return Response(status_code=200)

    return health


async def version(request: Request) -> Response:
    return JSONResponse({"version": metadata.version("splitserve")})


def _tokenize_prompt(body: dict[str, object]) -> PromptInput:
    if body.get("messages") is not None:
        return PromptInput(
            chat=chat_turns(body["messages"]),
            add_generation_prompt=read_field(body, "add_generation_prompt", as_bool, True),
            continue_final_message=read_field(body, "continue_final_message", as_bool, False),
            chat_template_kwargs=read_field(body, "chat_template_kwargs", as_object),
        )
    text = read_field(body, "prompt", as_str)
    if text is None:
        raise InvalidRequest("send `prompt` text or chat `messages` to tokenize", "prompt")
    return PromptInput(
        text=text, add_special_tokens=read_field(body, "add_special_tokens", as_bool, True)
    )


def tokenize_route(ctx: ServingContext) -> Handler:
    async def tokenize(request: Request) -> Response:
        """Tokenizing runs on the tokenizer threads; text longer than any prompt that fits
        max_model_len is refused first (as gRPC's Tokenize)."""
        body = await read_json(request, ctx.max_body_bytes)
        await ctx.resolve_model(read_field(body, "model", as_str))
        prompt = _tokenize_prompt(body)
        wants_strs = read_field(body, "return_token_strs", as_bool, False)
        inputs = ctx.inputs
        ids = (await inputs.run(inputs.tokenize, prompt)).token_ids
        strs = await inputs.run(ctx.tokenizer.convert_ids_to_tokens, ids) if wants_strs else None
        reply = {
            "count": len(ids),
            "max_model_len": ctx.info.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        return JSONResponse(reply)

    return tokenize


def detokenize_route(ctx: ServingContext) -> Handler:
    async def detokenize(request: Request) -> Response:
        """At most max_model_len ids, each in the vocabulary (as gRPC's Detokenize), counted
        before they are read; decoded on the tokenizer threads."""
        body = await read_json(request, ctx.max_body_bytes)
        await ctx.resolve_model(read_field(body, "model", as_str))
        raw = read_field(body, "tokens", as_list, [])
        ctx.inputs.check_num_token_ids(len(raw), "tokens")  # before each id is read
        ids = list(as_int_tuple(raw, "tokens"))
        ctx.inputs.check_token_ids(ids, "tokens")
        return JSONResponse({"prompt": await ctx.inputs.run(ctx.tokenizer.decode, ids)})

    return detokenize
