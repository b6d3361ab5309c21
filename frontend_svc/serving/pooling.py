"""Pooling requests (embeddings, classifications, scores), shared by the OpenAI route, the public gRPC API and the gateway
contract: build them from prompts, run them on the engine, turn each pooled vector into the
embedding the client asked for.

The engine returns the model's pooled vector (normalized as the checkpoint says); a Matryoshka
`dimensions` keeps its first values and normalizes them again (vLLM's order: truncate, then
normalize)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import EngineUnavailable, InvalidRequest, engine_error
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.requests import Embedding, EngineRequest, PromptInput
from splitserve_contracts.output_types import FinishReason, PoolerConfig
from splitserve_contracts.sampling_types import SamplingParams

EMBED_TASK = "embed"
SCORE_TASK = "score"
CLASSIFY_TASK = "classify"
_API_TASKS = {EMBED_TASK: "embed", SCORE_TASK: "classify", CLASSIFY_TASK: "classify"}
"""Request task -> the PoolerConfig.task of the models that serve it."""
_KINDS = {
    EMBED_TASK: "an embedding model",
    SCORE_TASK: "a cross-encoder with one label",
    CLASSIFY_TASK: "a sequence classifier (a *ForSequenceClassification checkpoint)",
}
_POOLING_PARAMS = SamplingParams(max_tokens=1)
"""What a pooling request's sampler part says: nothing is sampled (the engine checks)."""


def pooler_config(
    info: EngineInfo, api: str = "Embeddings API", task: str = EMBED_TASK
) -> PoolerConfig:
    """The engine's pooler; InvalidRequest (400, as vLLM) when it serves a generative model or
    a pooling model for the other task (an embedder for /score, a cross-encoder for
    /v1/embeddings, an embedder for /classify)."""
    config = info.pooler_config
    if config is None:
        raise InvalidRequest(
            f"the model {info.served_model_name!r} does not support the {api}: it is served for "
            "generation (serve a pooling model, or this one with --runner pooling)",
            "model",
        )
    if config.task != _API_TASKS[task] or (task == SCORE_TASK and config.hidden_size != 1):
        kind = _KINDS[task]
        raise InvalidRequest(
            f"the model {info.served_model_name!r} does not support the {api}: it is not {kind}",
            "model",
        )
    return config


def check_generative(info: EngineInfo, api: str) -> None:
    """InvalidRequest (400, as vLLM) for a generation call on an engine serving a pooling
    model."""
    if info.pooler_config is not None:
        raise InvalidRequest(
            f"the model {info.served_model_name!r} does not support the {api}: it is served "
            "as a pooling model (--runner pooling); use its pooling routes (/v1/embeddings, "
            "/pooling, /classify, /score, /rerank)",
            "model",
        )


def check_dimensions(config: PoolerConfig, dimensions: int | None, name: str) -> None:
    """`dimensions` must be a size the Matryoshka model was trained for (vLLM's checks)."""
    if dimensions is None:
        return
    if not config.is_matryoshka:
        raise InvalidRequest(
            "this model does not support Matryoshka representation; changing the output "
            "dimensions would give poor results (leave `dimensions` unset)",
            "dimensions",
        )
    sizes = config.matryoshka_dimensions
    if sizes and dimensions not in sizes:
        raise InvalidRequest(
            f"this model supports the Matryoshka dimensions {sizes} only; got {dimensions}",
            "dimensions",
        )
    if not 1 <= dimensions <= config.hidden_size:
        raise InvalidRequest(
            f"`dimensions` must be in [1, {config.hidden_size}], got {dimensions}", "dimensions"
        )


def embed_request(
    inputs: InputProcessor,
    request_id: str,
    prompt: PromptInput,
    field: str,
    priority: int = 0,
    task: str = EMBED_TASK,
) -> EngineRequest:
    """Tokenize and check one input for `task` (run it on the tokenizer threads)."""
    if prompt.token_ids is not None:
        inputs.check_token_ids(prompt.token_ids, field)
    try:
        token_ids = inputs.tokenize(prompt).token_ids
    except InvalidRequest as err:  # it names the generation APIs' field
        raise InvalidRequest(str(err), field) from None
    max_len = inputs.max_model_len
    if not token_ids:
        raise InvalidRequest("the input tokenizes to no tokens; send a non-empty input", field)
    if len(token_ids) >= max_len:
        raise InvalidRequest(
            f"the input has {len(token_ids)} tokens but max_model_len is {max_len}; shorten it "
            f"to at most {max_len - 1} tokens",
            field,
        )
    return EngineRequest(request_id, token_ids, _POOLING_PARAMS, None, priority, pooling_task=task)


def score_request(
    inputs: InputProcessor, request_id: str, query: str, document: str, priority: int = 0
) -> EngineRequest:
    """Tokenize one (query, document) pair as the cross-encoder reads it (the tokenizer's pair
    template) and check it fits (run it on the tokenizer threads)."""
    num_bytes = len(query.encode(errors="replace")) + len(document.encode(errors="replace"))
    if num_bytes > inputs.max_prompt_bytes:
        raise InvalidRequest(
            f"a pair has {num_bytes} bytes of text, more than any prompt that fits max_model_len "
            f"{inputs.max_model_len}; shorten it",
            "documents",
        )
    token_ids = list(inputs.tokenizer(query, document)["input_ids"])
    max_len = inputs.max_model_len
    if not token_ids or len(token_ids) >= max_len:
        raise InvalidRequest(
            f"a pair has {len(token_ids)} tokens; it must have 1 to {max_len - 1} "
            "(max_model_len - 1)",
            "documents",
        )
    return EngineRequest(
        request_id, token_ids, _POOLING_PARAMS, None, priority, pooling_task=SCORE_TASK
    )


async def embed_all(
    engine: AsyncEngine, requests: list[EngineRequest], config: PoolerConfig, dimensions: int | None
) -> list[Embedding]:
    """Run every request (admitted together); the first failure cancels the rest (their engine
    requests are aborted) and is raised."""
    engine.check_admission(len(requests))
    arrival = time.monotonic()
    tasks = [asyncio.ensure_future(_embed_one(engine, r, arrival)) for r in requests]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        pooled = [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [Embedding(_finish(data, config, dimensions), n) for data, n in pooled]


async def _embed_one(
    engine: AsyncEngine, request: EngineRequest, arrival: float
) -> tuple[bytes, int]:
    async for delta in engine.generate(request, arrival):
        if delta.finish_reason == FinishReason.ERROR:
            raise engine_error(request.request_id, delta.error_kind, delta.error_message)
        if delta.is_finished:
            return delta.pooling_output, delta.prompt_tokens
    raise EngineUnavailable("the engine ended the request without its embedding; retry")


def _finish(data: bytes, config: PoolerConfig, dimensions: int | None) -> np.ndarray:
    vector = np.frombuffer(data, dtype="<f4")
    if vector.size != config.hidden_size:
        raise EngineUnavailable(
            f"the engine sent a vector of {vector.size} values, not {config.hidden_size}; retry"
        )
    if dimensions is not None:
        vector = vector[:dimensions]
        if config.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)
