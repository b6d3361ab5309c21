"""AsyncEngine: the frontend's engine (vLLM's AsyncLLM): add a request, stream its deltas.

n > 1 is fanned out here into n engine requests (child i gets seed + i when a seed is set) whose
deltas are merged by `index`; the engine core never sees n > 1. A caller that stops consuming
(client cancel, deadline) aborts every unfinished child in the core, which frees their KV blocks.

When the stream to the engine core breaks (the core died; `splitserve up` or the kubelet
restarts it at the same address), the requests in flight pause instead of failing, for up to
`max_recovery_seconds`: once a new stream is open, each is resubmitted with its prompt and the
tokens it has so far, and continues where it stopped (its detokenizer and stop-string state never
left this process). Past the bound, or with a bound of 0, they fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from frontend_svc.engine.core_client import (
    CoreClient,
    Disconnected,
    Reconnected,
    RoundTrip,
    StatsRefresh,
)
from frontend_svc.engine.engine_types import CoreOutputs
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.engine.request_log import RequestLogger
from frontend_svc.errors import EngineUnavailable, InvalidRequest, Overloaded
from frontend_svc.kv_events.hub import KvEventHub, KvEvents
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.requests import CompletionDelta, EngineRequest, derived_request_id
from frontend_svc.tracing import RequestTracer
from splitserve_contracts import sampling_rules
from splitserve_contracts.output_types import FinishReason, SchedulerStats

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Multiplexes generate() calls over one CoreClient; one task pulls the core's events."""

    def __init__(
        self,
        client: CoreClient,
        output_processor: OutputProcessor,
        metrics: FrontendMetrics,
        max_inflight_requests: int = 0,
        max_recovery_seconds: float = 0.0,
        kv_events: KvEventHub | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.client = client
        self.tracer = tracer
        """Starts each request's spans (--otlp-traces-endpoint); None: not tracing."""
        self.kv_events = kv_events
        """Where the engine's KV-cache events go (when the client subscribed to them)."""
        self.max_inflight_requests = max_inflight_requests
        """When > 0, most engine requests in flight here (n > 1 counts n)."""
        self.max_recovery_seconds = max_recovery_seconds
        """How long requests in flight wait for a lost engine core to come back (0: fail)."""
        self._pause: RecoveryPause | None = None
        self.output_processor = output_processor
        self.metrics = metrics
        self.is_draining = False
        """Set on shutdown: new requests are refused, running ones finish."""
        self.scheduler_stats = SchedulerStats()
        """The engine core's scheduler after the latest step that sent this frontend outputs,
        or fetched when none did for a second (core_client.STATS_MAX_AGE_S)."""
        self.request_logger: RequestLogger | None = None
        """Set: one log line per finished request (--enable-log-requests)."""
        self._puller: asyncio.Task[None] | None = None
        self._abortable: dict[str, asyncio.Queue[Any]] = {}
        """Calls that `abort` can end, by request id."""

    def start(self) -> None:
        """Start pulling the core's events (call once, on the serving event loop)."""
        self._puller = asyncio.create_task(self._pull_events(), name="core-events")

    @property
    def is_ready(self) -> bool:
        return self.client.is_connected and not self.is_draining

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait up to `timeout` seconds for the running ones to finish
        (vLLM's --shutdown-timeout), then end the rest: their streams fail with UNAVAILABLE
        and the core aborts them (frees their KV blocks)."""
        self.is_draining = True
        deadline = time.monotonic() + timeout
        while self.output_processor.states and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        handles = sorted(self.output_processor.states)
        if not handles:
            return
        logger.warning(
            "shutdown: %g s passed; aborting %d requests still running", timeout, len(handles)
        )
        self.output_processor.fail_all(
            "this frontend is shutting down and its --shutdown-timeout passed; retry the request"
        )
        self.client.abort_requests(handles)

    @property
    def num_running(self) -> int:
        return len(self.output_processor.states)

    async def _pull_events(self) -> None:
        client = self.client
        while True:
            event = await client.next_event()
            try:
                if isinstance(event, CoreOutputs):
                    self._process(event)
                elif isinstance(event, KvEvents):
                    if self.kv_events is not None:
                        self.kv_events.apply(event.events)
                elif isinstance(event, RoundTrip):
                    self.metrics.core_rtt.observe(event.seconds)
                elif isinstance(event, StatsRefresh):
                    if event.stats.step_id >= self.scheduler_stats.step_id:  # not older
                        self.scheduler_stats = event.stats
                elif isinstance(event, Disconnected):
                    self.scheduler_stats = SchedulerStats()  # a new core counts steps from 1
                    self.metrics.reconnects.inc()
                    if self.kv_events is not None:
                        self.kv_events.clear()  # the new stream brings a fresh snapshot
                    self._on_core_lost(event.reason)
                else:
                    self._on_core_back(event)
            except Exception:  # one bad event must not stop the frontend
                logger.exception("processing an engine-core event failed")
            finally:
                client.event_done()

    def _on_core_lost(self, reason: str) -> None:
        """Pause the requests in flight (or fail them: no bound, or nothing to wait for). A core
        lost again before its resubmitted requests ran gets no fresh bound."""
        detail = f"engine core at {self.client.core_addr}: {reason}"
        states = self.output_processor.states
        if self.max_recovery_seconds <= 0 or not states:
            self._fail_paused(detail)
            return
        now = time.monotonic()
        started = now
        if self._pause is not None:
            self._pause.timer.cancel()
            started = self._pause.started
        remaining = max(0.0, started + self.max_recovery_seconds - now)
        timer = asyncio.get_running_loop().call_later(remaining, self._fail_paused, detail)
        self._pause = RecoveryPause(started, timer)
        logger.warning(
            "lost the engine core (%s); %d requests paused, waiting up to %.0f s for it",
            reason,
            len(states),
            remaining,
        )

    def _fail_paused(self, detail: str) -> None:
        if self._pause is not None:
            self._pause.timer.cancel()
            self._pause = None
        if self.output_processor.states:
            logger.error(
                "%d requests in flight lost with the engine core (%s)",
                len(self.output_processor.states),
                detail,
            )
        self.output_processor.fail_all("lost the engine core; retry the request", detail=detail)

    def _on_core_back(self, event: Reconnected) -> None:
        """A new stream is open: resubmit the paused requests (or fail them: another engine).
        The pause lasts until the engine sends outputs again."""
        pause = self._pause
        if pause is None:
            return
        if event.problem:
            self._fail_paused(f"engine core at {self.client.core_addr}: {event.problem}")
            return
        pause.timer.cancel()
        requests = self.output_processor.resubmissions()
        self.client.resubmit_requests(requests)
        self.metrics.resubmitted.inc(len(requests))
        logger.warning(
            "the engine core is back after %.2f s: %d requests resubmitted",
            time.monotonic() - pause.started,
            len(requests),
        )

    def _process(self, outputs: CoreOutputs) -> None:
        started = time.perf_counter()
        self._pause = None  # the engine steps again
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        to_abort = self.output_processor.process_outputs(outputs)
        self.client.abort_requests(to_abort)
        self.metrics.output_processing.observe(time.perf_counter() - started)

    def abort(self, request_ids: list[str]) -> int:
        """End the calls started with `abortable=True` under these ids (vLLM's
        AsyncLLM.abort): each unfinished completion gets a final ABORT delta and its engine
        request is aborted in the core, which frees its KV blocks. Unknown ids are ignored;
        returns how many calls were ended."""
        num_aborted = 0
        for request_id in request_ids:
            queue = self._abortable.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(_ABORTED)
                num_aborted += 1
        return num_aborted

    def check_admission(self, num_requests: int) -> None:
        """Refuse a call that would add `num_requests` engine requests now: EngineUnavailable
        while draining, Overloaded past --max-inflight-requests."""
        if self.is_draining:
            raise EngineUnavailable("this frontend is shutting down; retry the request elsewhere")
        limit, num_running = self.max_inflight_requests, len(self.output_processor.states)
        if limit and num_running + num_requests > limit:
            raise Overloaded(
                f"this frontend already streams {num_running} requests and this call needs "
                f"{num_requests} more (--max-inflight-requests {limit}); retry shortly"
            )

    async def generate(
        self,
        request: EngineRequest,
        arrival: float | None = None,
        coalesce: bool = True,
        abortable: bool = False,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of all `request.params.n` completions until every one finished.
        `arrival` (time.monotonic() when the call came in) anchors TTFT and E2E latency.
        With `coalesce`, deltas a slow consumer has not taken yet are merged; without it every
        engine step's delta arrives on its own (one token each: what SSE clients count).
        With `abortable`, `abort(request.request_id)` ends the call (the id must not belong
        to another abortable call in flight)."""
        self.check_admission(request.params.n)
        if abortable and request.request_id in self._abortable:
            raise InvalidRequest(
                f"request id {request.request_id} is already running; use a new id",
                "request_id",
            )
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.metrics.on_request(request.params.n, request.params.max_tokens or 0)
        arrival = arrival or time.monotonic()
        children = self._add(request, queue, arrival)
        if abortable:
            self._abortable[request.request_id] = queue
        remaining = set(children.values())
        lengths: list[int] = []  # completion_tokens of each finished index
        log = self.request_logger
        outcome = log.start(request, arrival) if log is not None else None
        unfinished = FinishReason.ABORT  # the caller stopped reading (cancel, deadline)
        try:
            while remaining:
                first = await queue.get()
                for item in _drain(first, queue) if coalesce else (first,):
                    if item is _ABORTED:
                        for index in sorted(i for i, h in children.items() if h in remaining):
                            yield _aborted_delta(index, request, self.output_processor, children)
                        return
                    if isinstance(item, Exception):
                        unfinished = FinishReason.ERROR
                        raise item
                    if item.is_finished:
                        lengths.append(item.completion_tokens)
                        if len(lengths) == request.params.n:
                            self.metrics.on_parent_finished(max(lengths))
                    if outcome is not None:
                        outcome.observe(item)
                    yield item
                    if item.is_finished:
                        remaining.discard(children[item.index])
        finally:
            if abortable and self._abortable.get(request.request_id) is queue:
                del self._abortable[request.request_id]
            if remaining:
                for handle in remaining:
                    self.output_processor.remove_request(handle)
                self.client.abort_requests(sorted(remaining))
            if log is not None and outcome is not None:
                log.finished(request, outcome, unfinished)

    def _add(
        self, request: EngineRequest, queue: asyncio.Queue[Any], arrival: float
    ) -> dict[int, int]:
        """Register and send the n child requests; returns index -> handle."""
        params = request.params
        children: dict[int, int] = {}
        batch: list[tuple[int, EngineRequest]] = []
        for index in range(params.n):
            seed = sampling_rules.child_seed(params.seed, index)
            child = dataclasses.replace(
                request,
                request_id=request.request_id
                if params.n == 1
                else derived_request_id(request.request_id, f"-{index}"),
                params=dataclasses.replace(params, n=1, seed=seed),
            )
            handle = self.client.next_handle()
            span = None
            if self.tracer is not None:
                span, context = self.tracer.start(child, arrival, with_tokenize=index == 0)
                child = dataclasses.replace(child, trace=context)
            state = self.output_processor.add_request(
                handle, index, child.params, len(request.prompt_token_ids), queue, arrival, child
            )
            state.span = span
            children[index] = handle
            batch.append((handle, child))
        try:
            self.client.add_requests(batch)
        except EngineUnavailable:
            for handle in children.values():
                self.output_processor.remove_request(handle)
            raise
        return children

    async def close(self) -> None:
        if self._pause is not None:
            self._pause.timer.cancel()
        self.output_processor.fail_all("the frontend is shutting down")
        if self._puller is not None:
            self._puller.cancel()
            await asyncio.wait([self._puller])
        await self.client.close()


_ABORTED = object()
"""Queued by `abort`: the call ends now."""


def _aborted_delta(
    index: int, request: EngineRequest, processor: OutputProcessor, children: dict[int, int]
) -> CompletionDelta:
    """The final delta of a completion ended by `abort`."""
    state = processor.states.get(children[index])
    return CompletionDelta(
        index=index,
        token_ids=[],
        text="",
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=state.num_output_tokens if state is not None else 0,
        cached_tokens=state.num_cached_tokens if state is not None else 0,
        finish_reason=FinishReason.ABORT,
    )


@dataclass(slots=True)
class RecoveryPause:
    """Requests in flight wait for a lost engine core: since `started` (the first loss since
    the engine last sent outputs), failed by `timer` unless it comes back."""

    started: float
    timer: asyncio.TimerHandle


def _drain(first: Any, queue: asyncio.Queue[Any]) -> list[Any]:
    """The first item plus everything already queued, consecutive deltas of one index merged
    (a slow consumer gets fewer, larger messages instead of falling behind)."""
    items = [first]
    while not queue.empty():
        item = queue.get_nowait()
        last = items[-1]
        if (
            isinstance(item, CompletionDelta)
            and isinstance(last, CompletionDelta)
            and last.index == item.index
            and not last.is_finished
        ):
            items[-1] = _merge(last, item)
        else:
            items.append(item)
    return items


def _merge(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    b.token_ids = a.token_ids + b.token_ids
    b.text = a.text + b.text
    b.logprobs = a.logprobs + b.logprobs
    b.prompt_logprobs = a.prompt_logprobs + b.prompt_logprobs
    return b
