"""What the engine core checks in every request a frontend sends: it is a peer, and a peer's
data is untrusted. A bad request is refused alone (INVALID_REQUEST); the engine keeps serving."""

from __future__ import annotations

from core_svc.mm_inputs import mm_features_problem
from core_svc.request import Request
from core_svc.sched.scheduler_config import SchedulerConfig
from splitserve_contracts.structured_outputs import InvalidStructuredOutputs, validate
from splitserve_runtime.engine_option_rules import lora_enabled

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_SAMPLER_PARAMS_BYTES = 1 << 20
MAX_STOP_TOKEN_IDS = 4096


def invalid_request_reason(request: Request, scheduler_config: SchedulerConfig) -> str | None:
    """Why the request cannot run as sent, or None. Called once per request, at add, after
    its stop and EOS ids past the vocabulary are dropped (Request.drop_unsampleable_stop_ids:
    a tokenizer's added EOS may lie past the embedding rows; it can never end the request)."""
    max_model_len = scheduler_config.max_model_len
    vocab_size = scheduler_config.vocab_size
    num_prompt_tokens = request.num_prompt_tokens
    if num_prompt_tokens == 0:
        return "the prompt is empty"
    if num_prompt_tokens >= max_model_len:
        return (
            f"the prompt ({num_prompt_tokens} tokens) leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    if request.pooling_task or scheduler_config.is_pooling:
        problem = _pooling_problem(request, scheduler_config.is_pooling)
        if problem is not None:
            return problem
    budget = scheduler_config.scheduler.max_num_batched_tokens
    if scheduler_config.is_encoder_only and num_prompt_tokens > budget:
        return (
            f"the prompt ({num_prompt_tokens} tokens) is longer than one step's token budget "
            f"(max_num_batched_tokens={budget}); an encoder-only model computes a prompt whole, "
            "in one step: shorten it, or serve with a larger --max-num-batched-tokens"
        )
    if request.max_tokens < 1:
        return f"max_tokens must be >= 1, got {request.max_tokens}"
    if max(request.prompt_token_ids) >= vocab_size:
        return f"a prompt token id is outside the vocabulary (valid ids: 0..{vocab_size - 1})"
    if request.output_token_ids:
        problem = _resumed_outputs_problem(request, scheduler_config)
        if problem is not None:
            return problem
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"{len(request.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}"
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        return f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters"
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters"
    if len(request.sampler_params) > MAX_SAMPLER_PARAMS_BYTES:
        return f"sampler_params is larger than {MAX_SAMPLER_PARAMS_BYTES} bytes"
    if request.lora is not None and (
        request.lora.lora_id == 0 or not lora_enabled(scheduler_config.lora)
    ):
        return _lora_problem(request.lora.name, scheduler_config)
    if request.structured_output is not None:
        try:
            validate(request.structured_output.params)
        except InvalidStructuredOutputs as err:
            return err.describe()
        end_id = request.structured_output.reasoning_end_token_id
        if end_id is not None and end_id >= vocab_size:
            return "reasoning_end_token_id is outside the vocabulary"
    return mm_features_problem(
        request.mm_features, num_prompt_tokens, scheduler_config.max_tokens_per_mm_item
    )


def kv_transfer_params_problem(request: Request, has_connector: bool) -> str | None:
    """The request's kv_transfer_params are no JSON object, or the engine has no KV connector to
    give them to (the connector checks what they say when it admits the request)."""
    if request.kv_transfer_params_problem:
        return request.kv_transfer_params_problem
    if request.kv_transfer_params is not None and not has_connector:
        return "kv_transfer_params: this engine has no KV connector (--kv-transfer-config)"
    return None


def _lora_problem(name: str, scheduler_config: SchedulerConfig) -> str:
    if not lora_enabled(scheduler_config.lora):
        return (
            f"the request names the LoRA adapter '{name[:MAX_CACHE_SALT_CHARS]}', but LoRA is "
            "off (the engine runs without --enable-lora)"
        )
    return (
        f"the LoRA adapter '{name[:MAX_CACHE_SALT_CHARS]}' is not loaded (it was unloaded, or "
        "never loaded); name a loaded adapter or the served model"
    )


def _resumed_outputs_problem(request: Request, scheduler_config: SchedulerConfig) -> str | None:
    """A resubmitted request's outputs must be valid ids and leave room to generate."""
    num_outputs = request.num_output_tokens
    if max(request.output_token_ids) >= scheduler_config.vocab_size:
        return "an output token id is outside the vocabulary"
    if num_outputs >= request.max_tokens or request.num_tokens >= scheduler_config.max_model_len:
        return (
            f"the request already has {num_outputs} output tokens: nothing is left to generate "
            f"within max_tokens={request.max_tokens} and max_model_len="
            f"{scheduler_config.max_model_len}"
        )
    return None


POOLING_TASKS = ("embed", "score", "classify")


def _pooling_problem(request: Request, is_pooling_engine: bool) -> str | None:
    """A pooling request needs a pooling engine (and the reverse); it generates nothing, so
    it carries no generation settings."""
    if not is_pooling_engine:
        return "this engine serves a generative model; it takes no pooling requests"
    if not request.pooling_task:
        return (
            "this engine serves a pooling model (--runner pooling); it only takes pooling requests"
        )
    if request.pooling_task not in POOLING_TASKS:
        return (
            f"pooling task {request.pooling_task[:32]!r} is not one of {', '.join(POOLING_TASKS)}"
        )
    if request.output_token_ids or request.structured_output is not None:
        return "a pooling request has no output tokens and no structured outputs"
    if request.min_tokens or request.stop_token_ids:
        return "a pooling request has no min_tokens and no stop token ids"
    return None
