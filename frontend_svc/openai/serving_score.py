"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), vLLM's shapes, on an engine
serving a cross-encoder (a `*ForSequenceClassification` checkpoint with one label): each
(query, document) pair is one pooling request whose score is the head's sigmoid output.

/score pairs `text_1` with `text_2` (one with many, or two lists of the same length); /rerank
scores `documents` against `query` and returns them best first (`top_n` of them)."""

from __future__ import annotations

from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai import generation
from frontend_svc.openai.fields import as_bool, as_int, as_list, as_str, read
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.protocol import PRIORITY, as_client_id
from frontend_svc.requests import derived_request_id
from frontend_svc.serving import pooling


def _texts(value: Any, name: str, max_items: int) -> list[str]:
    """A string or a non-empty list of strings (or {"text": ...} objects) of at most
    `max_items`."""
    if isinstance(value, str):
        return [value]
    items = as_list(value, name)
    if not 0 < len(items) <= max_items:
        raise InvalidRequest(f"`{name}` must hold 1 to {max_items} texts (--max-fan-out)", name)
    texts = []
    for i, item in enumerate(items):
        text = item.get("text") if isinstance(item, dict) else item
        texts.append(as_str(text, f"{name}[{i}]"))
    return texts


def _pairs(body: dict[str, Any], max_items: int) -> list[tuple[str, str]]:
    """/score's pairs: 1:1, 1:N or N:N (vLLM's rules)."""
    for name in ("text_1", "text_2"):
        if body.get(name) is None:
            raise InvalidRequest(f"`{name}` is required", name)
    firsts = _texts(body["text_1"], "text_1", max_items)
    seconds = _texts(body["text_2"], "text_2", max_items)
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise InvalidRequest(
            f"`text_1` has {len(firsts)} texts and `text_2` {len(seconds)}: send one `text_1`, "
            "or as many as `text_2`",
            "text_2",
        )
    return list(zip(firsts, seconds, strict=True))


async def _scores(
    ctx: ServingContext, body: dict[str, Any], pairs: list[tuple[str, str]], rid: str, api: str
) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens of all of them."""
    config = pooling.pooler_config(ctx.info, api, pooling.SCORE_TASK)
    priority = read(body, "priority", PRIORITY, 0)
    requests = [
        await ctx.inputs.run(
            pooling.score_request, ctx.inputs, derived_request_id(rid, f"-{i}"), q, d, priority
        )
        for i, (q, d) in enumerate(pairs)
    ]
    scored = await pooling.embed_all(ctx.engine, requests, config, None)
    return [float(s.vector[0]) for s in scored], sum(s.num_prompt_tokens for s in scored)


def _start(ctx: ServingContext, body: dict[str, Any], header_id: str | None, prefix: str) -> str:
    ctx.check_model(read(body, "model", as_str))
    if body.get("truncate_prompt_tokens") is not None:
        raise InvalidRequest(
            "`truncate_prompt_tokens` is not supported by splitserve; leave it out",
            "truncate_prompt_tokens",
        )
    if header_id is not None:
        as_client_id(header_id, "the x-request-id header")
    return generation.request_id(prefix, header_id, read(body, "request_id", as_str))


async def create_scores(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None
) -> dict[str, Any]:
    """The reply to one /score body."""
    rid = _start(ctx, body, header_id, "score")
    pairs = _pairs(body, ctx.max_fan_out)
    scores, num_tokens = await _scores(ctx, body, pairs, rid, "Score API")
    return {
        "id": rid,
        "object": "list",
        "created": generation.now(),
        "model": ctx.served_model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def create_rerank(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None
) -> dict[str, Any]:
    """The reply to one /rerank body: the documents best first, `top_n` of them (0 or unset:
    all)."""
    rid = _start(ctx, body, header_id, "rerank")
    if body.get("query") is None or body.get("documents") is None:
        raise InvalidRequest("`query` and `documents` are required", "query")
    query = as_str(body["query"], "query")
    documents = _texts(body["documents"], "documents", ctx.max_fan_out)
    if isinstance(body["documents"], str):
        raise InvalidRequest("`documents` must be a list of texts", "documents")
    top_n = read(body, "top_n", as_int, 0)
    if top_n < 0:
        raise InvalidRequest("`top_n` must be >= 0", "top_n")
    with_documents = read(body, "return_documents", as_bool, True)
    pairs = [(query, d) for d in documents]
    scores, num_tokens = await _scores(ctx, body, pairs, rid, "Rerank API")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or None]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": rid,
        "model": ctx.served_model_name,
        "usage": {"total_tokens": num_tokens},
        "results": results,
    }
