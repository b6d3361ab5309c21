"""EngineCoreProc: the busy loop thread, its routing, aborts and idle blocking.

Waits use generous timeouts only as hang guards; no assertion depends on timing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import EngineCommand, EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.outputs import EngineCoreOutputs
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import FinishReason, ModelRunnerOutput
from tests.unit.core.fake_executor import ClientView, FakeExecutor, make_engine, make_request

GUARD_S = 30.0


def NO_STATS(stats: object, step_seconds: float | None) -> None:  # noqa: N802
    """The loop's stats sink, unused here."""


def NOT_FAILED(message: str) -> None:  # noqa: N802
    """The loop's failure report, unused here."""


class RecordingQueue(queue.Queue[EngineCommand]):
    """Signals whenever the loop blocks on the queue, and records the step count then."""

    def __init__(self, engine: EngineCore) -> None:
        super().__init__()
        self.engine = engine
        self.blocked = threading.Event()
        self.steps_when_blocked: list[int] = []

    def get(self, block: bool = True, timeout: float | None = None) -> EngineCommand:
        if block and timeout is None:
            self.steps_when_blocked.append(self.engine.scheduler.step_id)
            self.blocked.set()
        return super().get(block, timeout)


class Sink:
    """Collects routed outputs; `finished` fires once `expected` requests finished. Being
    called on the loop thread, it clears `idle` (when given) at that moment, so the next
    `idle` signal is the loop blocking after the final outputs."""

    def __init__(self, expected: int, idle: threading.Event | None = None) -> None:
        self.idle = idle
        self.view = ClientView()
        self.lock = threading.Lock()
        self.expected = expected
        self.finished = threading.Event()
        self.got_tokens = threading.Event()
        self.batches: list[tuple[int, EngineCoreOutputs]] = []

    def __call__(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        with self.lock:
            self.batches.append((client_id, outputs))
            self.view.absorb({client_id: outputs})
            if outputs.new_token_ids:
                self.got_tokens.set()
            if len(self.view.finished) >= self.expected and not self.finished.is_set():
                if self.idle is not None:
                    self.idle.clear()
                self.finished.set()


@pytest.fixture
def loop_parts() -> Iterator[tuple[EngineCore, FakeExecutor, RecordingQueue]]:
    engine, executor = make_engine()
    yield engine, executor, RecordingQueue(engine)


def start(
    engine: EngineCore, sink: Sink, input_queue: RecordingQueue | None = None
) -> EngineCoreProc:
    proc = EngineCoreProc(engine, EngineInbox(input_queue), sink, NO_STATS, NOT_FAILED)
    proc.start()
    return proc


def test_routes_outputs_per_client_and_blocks_when_idle(loop_parts: Any) -> None:
    engine, executor, input_queue = loop_parts
    sink = Sink(expected=3, idle=input_queue.blocked)
    proc = start(engine, sink, input_queue)
    assert input_queue.blocked.wait(GUARD_S)
    assert input_queue.steps_when_blocked == [0], "idle at start: blocked, no step"
    proc.inbox.add_requests(7, [make_request(1, [1, 2, 3], client_id=7, max_tokens=3)])
    proc.inbox.add_requests(8, [make_request(1, [4, 5], client_id=8, max_tokens=2),
                          make_request(2, [6], client_id=8, max_tokens=4)])  # fmt: skip
    assert sink.finished.wait(GUARD_S)
    assert input_queue.blocked.wait(GUARD_S)
    proc.stop(GUARD_S)
    assert not proc.is_alive and executor.is_shut_down
    assert {c for c, _ in sink.batches} == {7, 8}
    for client_id, outputs in sink.batches:
        assert set(outputs.request_handles) <= {7: {1}, 8: {1, 2}}[client_id]
    assert sink.view.finished == {(7, 1): FinishReason.LENGTH, (8, 1): FinishReason.LENGTH,
                                  (8, 2): FinishReason.LENGTH}  # fmt: skip
    # Blocked again once idle, and no step ran while blocked.
    assert input_queue.steps_when_blocked[-1] == len(executor.seen)
    assert proc.latest_stats.num_used_blocks == 0


def test_close_client_aborts_all_of_its_requests(loop_parts: Any) -> None:
    engine, executor, input_queue = loop_parts
    executor.on_execute = lambda so: time.sleep(0.002)  # 200 steps outlast the close below
    sink = Sink(expected=1, idle=input_queue.blocked)
    proc = start(engine, sink, input_queue)
    proc.inbox.add_requests(
        1, [make_request(h, [h, 9], client_id=1, max_tokens=200) for h in (1, 2)]
    )
    proc.inbox.add_requests(2, [make_request(1, [3, 9], client_id=2, max_tokens=20)])
    assert sink.got_tokens.wait(GUARD_S)
    proc.inbox.close_client(1)
    assert sink.finished.wait(GUARD_S)
    assert input_queue.blocked.wait(GUARD_S)
    proc.stop(GUARD_S)
    assert sink.view.finished == {(2, 1): FinishReason.LENGTH}
    assert engine.make_stats().num_used_blocks == 0
    assert engine.client_requests == {}
    dropped = {h for so in executor.seen for h in so.finished_req_handles}
    assert dropped == {1, 2, 3}


def test_abort_during_a_step_suppresses_that_steps_output() -> None:
    engine, executor = make_engine()
    sink = Sink(expected=1)
    proc = EngineCoreProc(engine, EngineInbox(), sink, NO_STATS, NOT_FAILED)

    def abort_mid_step(so: SchedulerOutput) -> None:
        if so.step_id == 3:
            proc.inbox.abort_requests(1, [1])

    executor.on_execute = abort_mid_step
    proc.start()
    proc.inbox.add_requests(
        1, [make_request(1, [1, 2], max_tokens=50), make_request(2, [3], max_tokens=6)]
    )
    assert sink.finished.wait(GUARD_S)
    proc.stop(GUARD_S)
    assert len(sink.view.tokens[(1, 1)]) == 2, "tokens of steps 1 and 2 only"
    assert (1, 1) not in sink.view.finished
    assert executor.seen[3].finished_req_handles == [1]


def test_unexpected_error_fails_requests_through_the_sink() -> None:
    class CrashingExecutor(FakeExecutor):
        def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
            raise RuntimeError("bug in the executor")

    engine, _ = make_engine()
    engine.executor = CrashingExecutor(4, 64)
    sink = Sink(expected=2)
    proc = start(engine, sink)
    proc.inbox.add_requests(1, [make_request(1, [1, 2], max_tokens=5)])
    proc.inbox.add_requests(1, [make_request(2, [1, 2], max_tokens=5)])
    assert sink.finished.wait(GUARD_S)
    assert proc.is_alive
    assert engine.is_failed
    details = [d for _, o in sink.batches for d in o.details]
    assert {d.finish_reason for d in details} == {FinishReason.ERROR}
    assert any("bug in the executor" in d.error_message for d in details)
    sink.expected = 3
    sink.finished.clear()
    proc.inbox.add_requests(1, [make_request(3, [1], max_tokens=1)])
    assert sink.finished.wait(GUARD_S)
    assert sink.view.finished[(1, 3)] == FinishReason.ERROR
    proc.stop(GUARD_S)
    assert not proc.is_alive


def test_a_failing_sink_does_not_stop_the_loop() -> None:
    engine, _ = make_engine()
    sink = Sink(expected=1)

    def flaky(client_id: int, outputs: EngineCoreOutputs) -> None:
        if client_id == 1:
            raise ConnectionError("client went away")
        sink(client_id, outputs)

    proc = EngineCoreProc(engine, EngineInbox(), flaky, NO_STATS, NOT_FAILED)
    proc.start()
    proc.inbox.add_requests(1, [make_request(1, [1], client_id=1, max_tokens=3)])
    proc.inbox.add_requests(2, [make_request(1, [1], client_id=2, max_tokens=3)])
    assert sink.finished.wait(GUARD_S)
    proc.stop(GUARD_S)
    assert sink.view.finished == {(2, 1): FinishReason.LENGTH}


def test_a_frontend_that_stops_reading_is_dropped() -> None:
    import asyncio

    from core_svc.outputs import EngineCoreOutputs
    from core_svc.server import MAX_UNSENT_OUTPUTS, ClientStreams

    async def scenario() -> tuple[list[int], int]:
        streams = ClientStreams(asyncio.get_running_loop())
        dropped: list[int] = []
        streams.on_overflow = dropped.append
        client_id, queue = streams.open()
        for _ in range(MAX_UNSENT_OUTPUTS + 3):
            streams.deliver(client_id, EngineCoreOutputs())
        await asyncio.sleep(0.2)
        return dropped, queue.qsize()

    dropped, queued = asyncio.run(scenario())
    assert dropped == [1] and queued == MAX_UNSENT_OUTPUTS
