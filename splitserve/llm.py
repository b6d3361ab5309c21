"""`LLM`: the offline Python API, as vLLM's (`LLM(model=...).generate(prompts, params)`).

TP = PP = 1 runs the whole engine in this process (splitserve/inprocess.py: worker, core loop
and frontend pieces, no gRPC hop). TP or PP > 1 starts the worker ranks and the engine core as
child processes on loopback (the launcher's code) and runs the frontend pieces here over the
core's EngineStream. Either way the engine lives on a private asyncio loop in a daemon thread;
`close()` (or leaving a `with` block, or interpreter exit) stops it and every child process.
Constructing nothing starts nothing: `import splitserve` stays cheap.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from frontend_svc.assembly import Frontend, build_frontend
from frontend_svc.engine.core_client import EngineCoreClient
from frontend_svc.errors import FrontendError
from frontend_svc.inputs.model_files import load_model_files
from frontend_svc.requests import ChatTurn, GenerateInput, PromptInput
from splitserve.children import (
    Child,
    StackOptions,
    start_engine_children,
    stop_children,
    wait_ready,
)
from splitserve.inprocess import EngineSettings, InProcessEngine, start_in_process
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.tls import CORE_ROLE

T = TypeVar("T")
Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]}."""


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """A finished request (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt position, its token's logprob (None for
    the first position, as vLLM)."""


class LLM:
    """An engine for offline batched generation; see the module docstring."""

    def __init__(
        self,
        model: str = "",
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        startup_timeout: float = 900.0,
        **engine_args: Any,
    ) -> None:
        """`engine_args` are vLLM's engine arguments, the engine options by their field names
        (common.v1.EngineOptions: dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
        block_size, enable_prefix_caching, gpu_memory_utilization, kv_cache_memory_bytes, seed,
        enforce_eager, enable_expert_parallel, quantization, dequantize_gguf, kv_cache_dtype,
        scheduling options, ...; splitserve/inprocess.py ENGINE_ARGS), checked by their rules,
        and device, served_model_name, async_scheduling (None: on where it can run),
        speculative_config and kv_transfer_config (vLLM's dicts, e.g. {"method": "ngram",
        "num_speculative_tokens": 4}). An unknown name is a TypeError naming it, as in vLLM."""
        if not model:
            from splitserve_runtime.default_model import ensure_default_model

            model = str(ensure_default_model())
        self.options = EngineSettings.of(model, **engine_args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="llm")
        self._thread.start()
        self._children: list[Child] = []
        self._inprocess: InProcessEngine | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._children)
        self._counter = 0
        try:
            if tensor_parallel_size * pipeline_parallel_size == 1:
                self._inprocess = self._run(start_in_process(self.options))
                self.frontend = self._inprocess.frontend
            else:
                # The ranks and the core listen in plaintext on loopback: a random internal
                # secret keeps the machine's other users from driving them.
                secret = secrets.token_urlsafe(32)
                self._children += _spawn_engine(
                    self.options,
                    tensor_parallel_size,
                    pipeline_parallel_size,
                    startup_timeout,
                    secret,
                )
                core = self._children[-1].address
                self.frontend = self._run(_connect(self.options, core, secret))
        except BaseException:
            self.close()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._loop, self._children, self.frontend, self._inprocess
        )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (run together, as one batch); outputs in prompt order."""
        items = _prompt_list(prompts)
        return self._generate_all([_prompt_input(p) for p in items], sampling_params)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate answers to one conversation or a list of them (the model's chat template)."""
        is_one = bool(messages) and isinstance(messages[0], Mapping)
        conversations: list[Any] = [messages] if is_one else list(messages)
        prompts = [
            PromptInput(
                chat=tuple(ChatTurn(m["role"], m.get("content") or "") for m in conv),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self._generate_all(prompts, sampling_params)

    def _generate_all(
        self,
        prompts: list[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        calls = []
        for prompt, params in zip(prompts, params_list, strict=True):
            self._counter += 1
            calls.append(GenerateInput(str(self._counter), prompt, _tuples(params)))
        return self._run(_generate_batch(self.frontend, calls))

    def close(self) -> None:
        """Stop the engine and every child process (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tuples(params: SamplingParams) -> SamplingParams:
    """Lists where the contract view holds tuples (vLLM users write stop=["\\n"])."""
    changes: dict[str, Any] = {
        name: tuple(getattr(params, name))
        for name in ("stop", "stop_token_ids", "allowed_token_ids")
        if isinstance(getattr(params, name), list)
    }
    if isinstance(params.stop, str):
        changes["stop"] = (params.stop,)
    return replace(params, **changes) if changes else params


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(i, int) for i in items):
        return [items]  # one prompt of token ids
    return items


def _prompt_input(prompt: Prompt) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return PromptInput(token_ids=tuple(prompt["prompt_token_ids"]))
        return PromptInput(text=str(prompt["prompt"]))
    return PromptInput(token_ids=tuple(prompt))


async def _generate_one(frontend: Frontend, call: GenerateInput) -> RequestOutput:
    request = frontend.inputs.process(call)
    outputs = [CompletionOutput(i) for i in range(request.params.n)]
    num_cached = 0
    prompt_rows: list[dict[int, float] | None] = [None]
    async for delta in frontend.engine.generate(request):
        prompt_rows += [{r.chosen.token_id: r.chosen.logprob} for r in delta.prompt_logprobs]
        out = outputs[delta.index]
        out.text += delta.text
        out.token_ids += delta.token_ids
        num_cached = delta.cached_tokens
        if request.params.logprobs is not None:
            rows = [{r.chosen.token_id: r.chosen.logprob} for r in delta.logprobs]
            out.logprobs = (out.logprobs or []) + rows
        if delta.is_finished:
            if str(delta.finish_reason) == "error":
                raise FrontendError(delta.error_message or "the engine failed")
            out.finish_reason = str(delta.finish_reason)
            out.stop_reason = delta.stop_str if delta.stop_str is not None else delta.stop_token_id
    prompt = call.prompt.text
    return RequestOutput(
        call.request_id,
        prompt,
        request.prompt_token_ids,
        outputs,
        num_cached_tokens=num_cached,
        prompt_logprobs=prompt_rows if request.params.prompt_logprobs is not None else None,
    )


async def _generate_batch(frontend: Frontend, calls: list[GenerateInput]) -> list[RequestOutput]:
    return list(await asyncio.gather(*(_generate_one(frontend, c) for c in calls)))


def _spawn_engine(
    options: EngineSettings, tp: int, pp: int, timeout: float, secret: str
) -> list[Child]:
    stack = StackOptions(
        options.model,
        internal_secret=secret,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        log_level="warning",
        max_recovery_seconds=0.0,  # nothing here restarts a rank: fail at once
        service_flags={"core": options.core_flags(tp, pp)},
    )
    children = start_engine_children(stack)
    try:
        wait_ready(children, timeout)
    except BaseException:
        stop_children(children)
        raise
    return children


async def _connect(options: EngineSettings, core_addr: str, secret: str) -> Frontend:
    files = load_model_files(options.model)
    security = ChannelSecurity(None, CORE_ROLE, secret)
    client = EngineCoreClient(core_addr, security=security, tokenizer=files.tokenizer_info)
    info = await client.connect(60.0)
    name = options.served_model_name or info.served_model_name
    frontend = build_frontend(client, info, files, CollectorRegistry(), name)
    frontend.engine.start()
    return frontend


def _shutdown(
    loop: asyncio.AbstractEventLoop,
    children: list[Child],
    frontend: Frontend | None = None,
    inprocess: InProcessEngine | None = None,
) -> None:
    """Stop the engine on its loop, the core loop, the loop's thread and the children."""
    if frontend is not None and loop.is_running():
        future = asyncio.run_coroutine_threadsafe(frontend.engine.close(), loop)
        future.result(timeout=30)
    if inprocess is not None:
        inprocess.stop()
    loop.call_soon_threadsafe(loop.stop)
    stop_children(children)
