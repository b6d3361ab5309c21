"""POST /classify and /pooling, vLLM's shapes, with /v1/embeddings' inputs and checks (`input`
as a text, texts, token ids or lists of them; at most --max-fan-out).

/classify runs on an engine serving a sequence classifier (a *ForSequenceClassification
checkpoint): each input's class probabilities `probs` (classification.py says which
activation), the most probable class's `label` (config.json's id2label) and `num_classes`.
/pooling runs on any pooling engine and returns each input's pooled output as the model makes
it (an embedder's embedding, a classifier's probabilities) under `data`, float or base64 as
/v1/embeddings; its `task` must be the model's ("embed" or "classify"), per-token tasks are
refused."""

from __future__ import annotations

from typing import Any

import numpy as np

from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import InvalidRequest
from frontend_svc.openai.fields import as_bool, as_int, as_str, read
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.serving_embedding import (
    encode,
    encoding_format,
    list_reply,
    pooling_requests,
    refuse_unsupported,
)
from frontend_svc.requests import Embedding
from frontend_svc.serving import pooling
from splitserve_contracts.output_types import PoolerConfig

POOLING_TASKS = (pooling.EMBED_TASK, pooling.CLASSIFY_TASK)
PER_TOKEN_TASKS = ("token_embed", "token_classify", "encode", "plugin")


def use_activation(body: dict[str, Any], config: PoolerConfig) -> bool:
    """vLLM's get_use_activation: `use_activation`, else the older `softmax` or `activation`,
    else true; false (the head's raw scores) needs a head of more than one label (a one-label
    head's sigmoid runs on the workers)."""
    activate = True
    for name in ("activation", "softmax", "use_activation"):  # the last one set wins
        activate = read(body, name, as_bool, activate)
    if not activate and config.hidden_size == 1:
        raise InvalidRequest(
            "`use_activation: false` is not supported for a model with one label (its score "
            "comes through the head's sigmoid); leave it unset",
            "use_activation",
        )
    return activate


def _reply(
    ctx: ServingContext, rid: str, data: list[dict[str, Any]], outputs: list[Embedding]
) -> dict[str, Any]:
    num_tokens = sum(o.num_prompt_tokens for o in outputs)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
    return list_reply(ctx, rid, data, {**usage, "prompt_tokens_details": None})


async def create_classify(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None
) -> dict[str, Any]:
    """The reply to one /classify body."""
    ctx.check_model(read(body, "model", as_str))
    config = pooling.pooler_config(ctx.info, "Classification API", pooling.CLASSIFY_TASK)
    refuse_unsupported(body)
    activate = use_activation(body, config)
    rid, requests = await pooling_requests(ctx, body, header_id, "classify", pooling.CLASSIFY_TASK)
    outputs = await pooling.embed_all(ctx.engine, requests, config, None)
    data = []
    for i, output in enumerate(outputs):
        probs = ctx.classifier.probs(output.vector, activate)
        label = ctx.classifier.label(int(np.argmax(probs)))
        data.append(
            {"index": i, "label": label, "probs": probs.tolist(), "num_classes": len(probs)}
        )
    return _reply(ctx, rid, data, outputs)


def _task(info: EngineInfo, body: dict[str, Any]) -> str:
    """The request's `task`: the model's own when unset."""
    config = info.pooler_config
    own = pooling.CLASSIFY_TASK if config is not None and config.task == "classify" else "embed"
    task: str = read(body, "task", as_str, own)
    if task in PER_TOKEN_TASKS:
        raise InvalidRequest(
            f"task {task!r} is not supported by splitserve (no per-token or plugin pooling); "
            f"send {own!r}, the model's task, or leave `task` out",
            "task",
        )
    if task not in POOLING_TASKS:
        raise InvalidRequest(
            f"`task` must be one of {', '.join(POOLING_TASKS)}, got {task[:32]!r}", "task"
        )
    return task


def _check_normalize(body: dict[str, Any], config: PoolerConfig) -> None:
    """`normalize` may only say what the model does (the engine normalizes as it says)."""
    normalize = read(body, "normalize", as_bool)
    if normalize is not None and normalize != config.normalize:
        does = "normalizes" if config.normalize else "does not normalize"
        raise InvalidRequest(
            f"this model {does} its embeddings; `normalize: {str(normalize).lower()}` is not "
            "supported (leave it unset)",
            "normalize",
        )


async def create_pooling(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None
) -> dict[str, Any]:
    """The reply to one /pooling body."""
    ctx.check_model(read(body, "model", as_str))
    task = _task(ctx.info, body)
    config = pooling.pooler_config(ctx.info, f"Pooling API with task {task!r}", task)
    refuse_unsupported(body)
    encoding = encoding_format(body)
    dimensions, activate = None, True
    if task == pooling.EMBED_TASK:
        dimensions = read(body, "dimensions", as_int)
        pooling.check_dimensions(config, dimensions, "dimensions")
        _check_normalize(body, config)
    else:
        activate = use_activation(body, config)
    rid, requests = await pooling_requests(ctx, body, header_id, "pool", task)
    outputs = await pooling.embed_all(ctx.engine, requests, config, dimensions)
    data = []
    for i, output in enumerate(outputs):
        vector = output.vector
        if task == pooling.CLASSIFY_TASK:
            vector = ctx.classifier.probs(vector, activate)
        data.append({"index": i, "object": "pooling", "data": encode(vector, encoding)})
    return _reply(ctx, rid, data, outputs)
