"""StepBuilder: assembles one engine step (SchedulerOutput) and owns its order.

The contract fixes the order of a step: new requests first (scheduled_new_reqs), then the cached
ones in req_handles order, running requests before resumed ones; num_scheduled_tokens has one
entry per request in exactly that order, and so does the list of scheduled requests the
scheduler later pairs with the workers' output. The scheduler adds requests in whatever order
its passes meet them; the builder files each under its kind and `build` concatenates and checks.
"""

from __future__ import annotations

from collections.abc import Sequence

from core_svc.kv_cache.block_pool import KVCacheBlock
from core_svc.request import Request
from core_svc.sched.scheduler_output import NewRequestData, SchedulerOutput


class StepBuilder:
    """One step under construction; see the module docstring."""

    __slots__ = (
        "output",
        "_new_reqs",
        "_num_new",
        "_running_reqs",
        "_num_running",
        "_resumed_reqs",
        "_num_resumed",
        "_handles",
        "_computed",
        "_num_block_ids",
        "_block_ids",
        "_num_token_ids",
        "_token_ids",
        "_num_spec",
    )

    def __init__(self, step_id: int, finished_req_handles: list[int]) -> None:
        self.output = SchedulerOutput(step_id=step_id, finished_req_handles=finished_req_handles)
        self._new_reqs: list[Request] = []
        self._num_new: list[int] = []
        self._running_reqs: list[Request] = []
        self._num_running: list[int] = []
        self._resumed_reqs: list[Request] = []
        self._num_resumed: list[int] = []
        cached = self.output.scheduled_cached_reqs  # its columns, bound once for add_running
        self._handles = cached.req_handles
        self._computed = cached.num_computed_tokens
        self._num_block_ids = cached.num_new_block_ids
        self._block_ids = cached.new_block_ids
        self._num_token_ids = cached.num_new_token_ids
        self._token_ids = cached.new_token_ids
        self._num_spec: dict[int, int] = {}
        """req_handle -> draft slots, for the running requests that have some."""

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self._new_reqs) + len(self._running_reqs) + len(self._resumed_reqs)

    def add_running(
        self,
        request: Request,
        num_new_tokens: int,
        new_blocks: Sequence[KVCacheBlock],
        num_spec: int = 0,
    ) -> None:
        """A running request's diff: its new blocks and the tokens it sampled since it was
        last sent; `num_spec` of its num_new_tokens are draft slots. The hot path of a decode
        step, so: a few list appends. Call it before advancing the request's
        num_computed_tokens."""
        if num_spec:
            self._num_spec[request.req_handle] = num_spec
        self._running_reqs.append(request)
        self._num_running.append(num_new_tokens)
        self._handles.append(request.req_handle)
        self._computed.append(request.num_computed_tokens)
        if new_blocks:
            self._num_block_ids.append(len(new_blocks))
            self._block_ids.extend([block.block_id for block in new_blocks])
        else:
            self._num_block_ids.append(0)
        all_token_ids = request.all_token_ids
        num_sent = request.num_sent_token_ids
        num_tokens = len(all_token_ids)
        if num_tokens - num_sent == 1:
            self._num_token_ids.append(1)
            self._token_ids.append(all_token_ids[-1])
        else:
            self._num_token_ids.append(num_tokens - num_sent)
            self._token_ids.extend(all_token_ids[num_sent:])
        request.num_sent_token_ids = num_tokens

    def remove_running(self, request: Request) -> int | None:
        """Take a running request back out of the step (preempted after it was scheduled);
        returns its scheduled tokens, or None when it was not in the step."""
        try:
            index = self._running_reqs.index(request)
        except ValueError:
            return None
        self.output.scheduled_cached_reqs.remove_entry(index)
        self._num_spec.pop(request.req_handle, None)
        del self._running_reqs[index]
        return self._num_running.pop(index)

    def add_new(
        self, request: Request, num_new_tokens: int, block_ids: list[int], state_slot: int = 0
    ) -> None:
        """A request the workers have never seen: sent in full, once (with its state slot, a
        model with state layers)."""
        self.output.scheduled_new_reqs.append(
            NewRequestData(
                req_handle=request.req_handle,
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampler_params=request.sampler_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                stop_token_ids=tuple(sorted(request.all_stop_token_ids)),
                min_tokens=request.min_tokens,
                mm_features=[f.serialized for f in request.mm_features],
                output_token_ids=list(request.output_token_ids),  # it grows in place
                lora_id=0 if request.lora is None else request.lora.lora_id,
                trace=request.trace.for_workers if request.trace is not None else None,
                pooling_task=request.pooling_task,
                state_slot=state_slot,
            )
        )
        request.is_known_to_workers = True
        request.num_sent_token_ids = len(request.all_token_ids)
        self._new_reqs.append(request)
        self._num_new.append(num_new_tokens)

    def add_resumed(
        self, request: Request, num_new_tokens: int, block_ids: list[int], state_slot: int = 0
    ) -> None:
        """A request back from preemption: its block list (and state slot) and all its tokens
        are replaced."""
        self.output.scheduled_cached_reqs.add_resumed(
            request.req_handle,
            request.num_computed_tokens,
            block_ids,
            request.all_token_ids,
            state_slot,
        )
        request.num_sent_token_ids = len(request.all_token_ids)
        self._resumed_reqs.append(request)
        self._num_resumed.append(num_new_tokens)

    def add_encoder_inputs(self, request: Request, input_ids: list[int]) -> None:
        """Items of a scheduled request whose encoder runs in this step."""
        self.output.scheduled_encoder_inputs[request.req_handle] = input_ids

    def remove_encoder_inputs(self, request: Request) -> list[int]:
        """Take a request's encoder inputs back out of the step (it was preempted)."""
        return self.output.scheduled_encoder_inputs.pop(request.req_handle, [])

    def build(self) -> tuple[SchedulerOutput, list[Request]]:
        """The step and its requests, both in the contract's order (checked)."""
        output = self.output
        output.num_scheduled_tokens = [*self._num_new, *self._num_running, *self._num_resumed]
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens)
        scheduled = [*self._new_reqs, *self._running_reqs, *self._resumed_reqs]
        if self._num_spec:
            num_spec = self._num_spec
            output.num_spec_tokens = [num_spec.get(r.req_handle, 0) for r in scheduled]
        cached = output.scheduled_cached_reqs
        num_running = len(self._running_reqs)
        if not (
            len(output.scheduled_new_reqs) == len(self._new_reqs)
            and len(cached.req_handles) == num_running + len(self._resumed_reqs)
            and cached.req_handles[num_running:] == cached.resumed_req_handles
            and len(output.num_scheduled_tokens) == len(scheduled)
        ):
            raise AssertionError(
                f"step {output.step_id}: its columns and requests disagree (running requests "
                "must be added before resumed ones)"
            )
        return output, scheduled
