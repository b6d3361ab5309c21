"""A scripted stand-in for the worker ranks, plus builders for engine-core tests.

FakeExecutor behaves like a real rank: it rebuilds each request's tokens and block table
from SchedulerOutputs alone (new requests in full, then diffs, resumed requests replaced)
and "computes" KV by writing (position, token) into block slots. Every step it checks that
the whole attention context of each scheduled request (positions below what it computes)
holds exactly that request's tokens, so a wrong prefix hit, a block reused while still in
use or a broken diff fails the test with an AssertionError. Sampled tokens are a pure
function of (request_id, output index), so preemption cannot change them.

With `feeds_sampled` it behaves like a rank under async scheduling: a sampled token joins the
request's tokens at once (the next step, scheduled before this one's output was applied, takes
it as its input) and the engine core must send no token ids for it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core_svc.engine.engine_core import EngineCore
from core_svc.executor.abstract import ExecutorError
from core_svc.kv_connector.base import KVConnectorScheduler
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import Request
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.output_types import (
    FinishReason,
    LogprobsTable,
    ModelRunnerOutput,
    PoolerOutput,
    RequestLogprobs,
    StepStatus,
)

TokenFn = Callable[[str, int], int]


def default_token_fn(request_id: str, output_index: int) -> int:
    """Deterministic pseudo-random token in [100, 1100) per (request, output index)."""
    digest = hashlib.sha256(f"{request_id}:{output_index}".encode()).digest()
    return 100 + int.from_bytes(digest[:4], "little") % 1000


def pooled_bytes(token_ids: list[int]) -> bytes:
    """What the fake ranks pool for a prompt: its tokens' sum and count, as two float32."""
    return struct.pack("<2f", float(sum(token_ids)), float(len(token_ids)))


@dataclass
class ShadowRequest:
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    wants_logprobs: bool = False
    wants_prompt_logprobs: bool = False
    unsent_sampled: list[int] = field(default_factory=list)
    is_pooling: bool = False


class FakeExecutor:
    """See the module docstring. `scripts[request_id]` overrides token_fn per request;
    `fail_at_step` makes that step raise ExecutorError; `on_execute` runs inside each
    step (to simulate things that happen while the model runs)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        token_fn: TokenFn = default_token_fn,
        verify_context: bool = True,
        feeds_sampled: bool = False,
    ) -> None:
        self.block_size = block_size
        self.feeds_sampled = feeds_sampled
        self.token_fn = token_fn
        self.verify_context = verify_context
        self.scripts: dict[str, list[int]] = {}
        self.fail_at_step: int | None = None
        self.refuse: dict[str, str] = {}
        """request_id -> reason: the ranks refuse these new requests (their data is "invalid")."""
        self.refused_handles: set[int] = set()
        self.on_execute: Callable[[SchedulerOutput], None] | None = None
        self.seen: list[SchedulerOutput] = []
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.reqs: dict[int, ShadowRequest] = {}
        self.is_shut_down = False
        self.first_step_id: int | None = None
        """The first step this executor ran (an engine that recovered goes on counting)."""

    def shutdown(self) -> None:
        self.is_shut_down = True

    def sample(self, shadow: ShadowRequest) -> int:
        output_index = len(shadow.token_ids) - shadow.num_prompt_tokens
        script = self.scripts.get(shadow.request_id)
        if script is not None and output_index < len(script):
            return script[output_index]
        return self.token_fn(shadow.request_id, output_index)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        if self.first_step_id is None:
            self.first_step_id = so.step_id
        assert so.step_id == self.first_step_id + len(self.seen), "step ids must count up by 1"
        self.seen.append(so)
        if self.on_execute is not None:
            self.on_execute(so)
        if self.fail_at_step == so.step_id:
            raise ExecutorError(f"rank 0 lost at step {so.step_id}")
        for handle in so.finished_req_handles:
            known = self.reqs.pop(handle, None) is not None or handle in self.refused_handles
            assert known, f"unknown finished handle {handle}"
        scheduled = self._apply_new(so) + self._apply_cached(so)
        assert len(scheduled) == len(so.num_scheduled_tokens)
        assert sum(so.num_scheduled_tokens) == so.total_num_scheduled_tokens
        out = ModelRunnerOutput(step_id=so.step_id, status=StepStatus.OK)
        for handle, num_tokens in zip(scheduled, so.num_scheduled_tokens, strict=True):
            reason = self.refuse.get(self.reqs[handle].request_id)
            if reason is not None:
                out.failed_req_handles.append(handle)
                out.failed_reasons.append(reason)
                del self.reqs[handle]
                self.refused_handles.add(handle)
                continue
            shadow = self.reqs[handle]
            assert num_tokens > 0
            self._compute(shadow, num_tokens)
            if shadow.is_pooling:
                assert shadow.num_computed_tokens <= shadow.num_prompt_tokens, "a pooling decode"
                if shadow.num_computed_tokens == shadow.num_prompt_tokens:
                    out.pooler_outputs.append(PoolerOutput(handle, pooled_bytes(shadow.token_ids)))
                continue
            if shadow.num_computed_tokens == len(shadow.token_ids):
                token = self.sample(shadow)
                if self.feeds_sampled:
                    shadow.token_ids.append(token)
                else:
                    shadow.unsent_sampled.append(token)
                out.req_handles.append(handle)
                out.sampled_token_ids.append(token)
                if shadow.wants_logprobs:
                    table = LogprobsTable(0, [token], [-0.5], [1])
                    out.logprobs.append(RequestLogprobs(handle, table))
                if (
                    shadow.wants_prompt_logprobs
                    and len(shadow.token_ids) == shadow.num_prompt_tokens
                ):
                    n = shadow.num_prompt_tokens - 1
                    table = LogprobsTable(0, shadow.token_ids[1:], [-1.0] * n, [1] * n)
                    out.prompt_logprobs.append(RequestLogprobs(handle, table))
        return out

    def _apply_new(self, so: SchedulerOutput) -> list[int]:
        handles = []
        for new in so.scheduled_new_reqs:
            assert new.req_handle not in self.reqs, "a new request must be new to the ranks"
            assert 0 not in new.block_ids, "block 0 is the reserved null block"
            sp = types_pb2.SamplerParams.FromString(new.sampler_params)
            shadow = ShadowRequest(
                request_id=new.request_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                wants_logprobs=sp.HasField("logprobs"),
                wants_prompt_logprobs=sp.HasField("prompt_logprobs"),
                is_pooling=bool(new.pooling_task),
            )
            self.reqs[new.req_handle] = shadow
            self._check_context(shadow, shadow.num_computed_tokens)
            handles.append(new.req_handle)
        return handles

    def _apply_cached(self, so: SchedulerOutput) -> list[int]:
        c = so.scheduled_cached_reqs
        resumed = dict(zip(c.resumed_req_handles, c.num_resumed_token_ids, strict=True))
        block_offset = token_offset = resumed_offset = 0
        for i, handle in enumerate(c.req_handles):
            shadow = self.reqs[handle]
            new_blocks = c.new_block_ids[block_offset : block_offset + c.num_new_block_ids[i]]
            block_offset += c.num_new_block_ids[i]
            new_tokens = c.new_token_ids[token_offset : token_offset + c.num_new_token_ids[i]]
            token_offset += c.num_new_token_ids[i]
            assert 0 not in new_blocks, "block 0 is the reserved null block"
            if handle in resumed:
                n = resumed[handle]
                all_tokens = c.resumed_all_token_ids[resumed_offset : resumed_offset + n]
                resumed_offset += n
                if self.feeds_sampled:  # the core may have dropped what steps in flight sampled
                    common = min(len(all_tokens), len(shadow.token_ids))
                    assert all_tokens[:common] == shadow.token_ids[:common]
                else:
                    assert all_tokens[: len(shadow.token_ids)] == shadow.token_ids
                    assert all_tokens[len(shadow.token_ids) :] == shadow.unsent_sampled
                shadow.token_ids = list(all_tokens)
                shadow.unsent_sampled = []
                shadow.block_ids = list(new_blocks)
                shadow.num_computed_tokens = c.num_computed_tokens[i]
                self._check_context(shadow, shadow.num_computed_tokens)
            else:
                assert c.num_computed_tokens[i] == shadow.num_computed_tokens
                assert new_tokens == shadow.unsent_sampled, "new_token_ids = sampled since last"
                shadow.token_ids += new_tokens
                shadow.unsent_sampled = []
                shadow.block_ids += new_blocks
        assert block_offset == len(c.new_block_ids)
        assert token_offset == len(c.new_token_ids)
        assert resumed_offset == len(c.resumed_all_token_ids)
        return list(c.req_handles)

    def _compute(self, shadow: ShadowRequest, num_tokens: int) -> None:
        start = shadow.num_computed_tokens
        end = start + num_tokens
        assert end <= len(shadow.token_ids), "cannot compute tokens that do not exist yet"
        assert len(shadow.block_ids) * self.block_size >= end, "blocks must cover the step"
        if self.verify_context:
            self._check_context(shadow, start)
        bs = self.block_size
        for pos in range(start, end):
            self.kv[shadow.block_ids[pos // bs]][pos % bs] = (pos, shadow.token_ids[pos])
        shadow.num_computed_tokens = end

    def _check_context(self, shadow: ShadowRequest, num_tokens: int) -> None:
        bs = self.block_size
        for pos in range(num_tokens):
            got = self.kv[shadow.block_ids[pos // bs]][pos % bs]
            assert got == (pos, shadow.token_ids[pos]), (
                f"{shadow.request_id}: KV at position {pos} is {got}, "
                f"expected {(pos, shadow.token_ids[pos])}"
            )


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    can_recover: bool = False,
    prefill_token_budget: int = 0,
    async_scheduling: bool = False,
    adaptive_prefill_chunk: int = 0,
    kv_connector: KVConnectorScheduler | None = None,
    executor_class: type[FakeExecutor] | None = None,
    num_state_slots: int = 0,
    **limits: int,
) -> tuple[EngineCore, FakeExecutor]:
    """An engine on the FakeExecutor (or `executor_class`, one of its kind); the adaptive
    prefill chunk is off unless asked for, so the tests of the static limits and of async
    scheduling see vLLM's behaviour."""
    scheduler_config = SchedulerConfig.of(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        prefill_token_budget=prefill_token_budget,
        async_scheduling=async_scheduling,
        adaptive_prefill_chunk=adaptive_prefill_chunk,
        **limits,
    )
    cache_config = CacheConfig.of(
        num_blocks,
        num_state_slots=num_state_slots,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    executor = (executor_class or FakeExecutor)(
        block_size, num_blocks, feeds_sampled=async_scheduling
    )
    engine = EngineCore(
        scheduler_config, cache_config, executor, can_recover, kv_connector=kv_connector
    )
    return engine, executor


def make_request(
    client_handle: int,
    prompt_token_ids: list[int],
    client_id: int = 1,
    eos_token_id: int | None = None,
    cache_salt: str = "",
    priority: int = 0,
    request_id: str | None = None,
    *,
    max_tokens: int | None = 4,
    min_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    output_token_ids: list[int] | None = None,
    is_resumed: bool = False,
    pooling_task: str = "",
    **sampler: Any,
) -> Request:
    """A request as a frontend would send it: ignore_eos drops eos_token_id, max_tokens None
    means all of max_model_len, the rest are SamplerParams fields (forwarded serialized)."""
    return Request(
        client_id=client_id,
        client_handle=client_handle,
        request_id=request_id or f"req-{client_id}-{client_handle}",
        prompt_token_ids=list(prompt_token_ids),
        max_tokens=1 << 30 if max_tokens is None else max_tokens,
        output_token_ids=output_token_ids,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        eos_token_id=None if ignore_eos else eos_token_id,
        sampler_params=types_pb2.SamplerParams(**sampler).SerializeToString(),
        skip_reading_prefix_cache=sampler.get("prompt_logprobs") is not None,
        cache_salt=cache_salt,
        priority=priority,
        is_resumed=is_resumed,
        pooling_task=pooling_task,
    )


@dataclass
class ClientView:
    """What a client has received, per (client_id, client_handle)."""

    tokens: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    finished: dict[tuple[int, int], FinishReason] = field(default_factory=dict)
    details: dict[tuple[int, int], list[EngineCoreOutput]] = field(default_factory=dict)

    def absorb(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for client_id, out in outputs.items():
            offset = 0
            for handle, n in zip(out.request_handles, out.num_new_tokens, strict=True):
                key = (client_id, handle)
                assert key not in self.finished, f"{key} got tokens after it finished"
                self.tokens.setdefault(key, []).extend(out.new_token_ids[offset : offset + n])
                offset += n
            for detail in out.details:
                key = (client_id, detail.request_handle)
                self.details.setdefault(key, []).append(detail)
                if detail.finish_reason is not None:
                    self.finished[key] = detail.finish_reason


def run_to_completion(
    engine: EngineCore, view: ClientView | None = None, max_steps: int = 1000
) -> ClientView:
    view = view or ClientView()
    for _ in range(max_steps):
        if not engine.has_work():
            return view
        view.absorb(engine.step())
    raise AssertionError(f"engine still busy after {max_steps} steps")
