"""EngineCore and EngineCoreProc through a rank restart: suspend on a failed step, keep every
request, resume on new ranks by recompute; resubmitted requests (a restarted core) continue after
the outputs they bring. The FakeExecutor samples a pure function of (request, output index) and
checks every KV context it attends to, so a resumed request must reproduce an undisturbed run."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.executor.abstract import Fault
from core_svc.outputs import EngineCoreOutputs
from splitserve_contracts.output_types import ErrorKind, FinishReason
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    default_token_fn,
    make_engine,
    make_request,
    run_to_completion,
)

PROMPTS = {h: [h, h + 1, h + 2, 7, 8, 9, 10][: 3 + h % 5] for h in range(1, 9)}
GUARD_S = 30.0


def add_all(engine: EngineCore, max_tokens: int = 12) -> None:
    for handle, prompt in PROMPTS.items():
        engine.add_request(make_request(handle, prompt, max_tokens=max_tokens, ignore_eos=True))


def undisturbed(max_tokens: int = 12) -> ClientView:
    engine, _ = make_engine(max_num_seqs=4, num_blocks=24)
    add_all(engine, max_tokens)
    return run_to_completion(engine)


def assert_no_blocks_held(engine: EngineCore) -> None:
    stats = engine.make_stats()
    assert (stats.num_running_reqs, stats.num_used_blocks, stats.kv_cache_usage) == (0, 0, 0.0)


def test_a_failed_step_suspends_and_the_new_ranks_recompute_every_request() -> None:
    engine, executor = make_engine(max_num_seqs=4, num_blocks=24, can_recover=True)
    add_all(engine)
    view = ClientView()
    for _ in range(6):
        view.absorb(engine.step())
    assert engine.scheduler.running, "some requests run when the rank dies"
    executor.fail_at_step = engine.scheduler.step_id + 1
    assert engine.step() == {}  # no request ends: the engine suspends
    assert engine.suspension is not None and engine.suspension.cause == "rank_died"
    assert not engine.is_failed and not engine.has_work()
    assert engine.num_requests == len(PROMPTS)
    assert_no_blocks_held(engine)
    assert all(not r.is_known_to_workers for r in engine.scheduler.requests.values())
    new_ranks = FakeExecutor(block_size=4, num_blocks=20)
    assert engine.resume(new_ranks, num_blocks=20) == {}
    assert engine.kv_cache_manager.block_pool.num_usable_blocks == 19
    view = run_to_completion(engine, view)
    expected = undisturbed()
    assert view.tokens == expected.tokens
    assert set(view.finished.values()) == {FinishReason.LENGTH}
    assert new_ranks.first_step_id == executor.first_step_id + len(executor.seen)
    assert engine.scheduler.num_preemptions == 0, "a recovery is not a preemption"


def test_adds_and_aborts_while_suspended_are_kept_in_order() -> None:
    engine, executor = make_engine(max_num_seqs=4, num_blocks=24, can_recover=True)
    add_all(engine)
    for _ in range(3):
        engine.step()
    engine.on_fault(Fault("rank_hung", "a step outlived its timeout"))
    assert engine.suspension == Fault("rank_hung", "a step outlived its timeout")
    engine.add_request(make_request(20, [5, 6, 7], max_tokens=12, ignore_eos=True))
    engine.abort_requests(1, [1, 2])
    outputs = engine.step()  # the abort's stats, no step
    assert len(executor.seen) == 3 and set(outputs) == {1}
    assert not engine.has_work()
    engine.resume(FakeExecutor(block_size=4, num_blocks=24), num_blocks=24)
    view = run_to_completion(engine)
    assert (1, 1) not in view.finished and (1, 2) not in view.finished
    assert view.finished[(1, 20)] == FinishReason.LENGTH
    assert_no_blocks_held(engine)
    assert engine.client_requests == {}


def test_requests_that_no_longer_fit_a_smaller_cache_fail_alone() -> None:
    engine, _ = make_engine(max_num_seqs=4, num_blocks=24, can_recover=True)
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=60, ignore_eos=True))  # 16 blocks
    engine.add_request(make_request(2, [4, 5, 6], max_tokens=4, ignore_eos=True))
    engine.step()
    engine.on_fault(Fault("rank_died", "rank 1 exited"))
    outputs = engine.resume(FakeExecutor(block_size=4, num_blocks=8), num_blocks=8)
    (detail,) = outputs[1].details
    assert detail.request_handle == 1 and detail.finish_reason == FinishReason.ERROR
    assert detail.error_kind == ErrorKind.ENGINE_FAILURE and "shrank" in detail.error_message
    view = run_to_completion(engine)
    assert view.finished == {(1, 2): FinishReason.LENGTH}


def test_without_recovery_a_fault_fails_every_request() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=10))
    engine.step()
    outputs = engine.on_fault(Fault("rank_died", "rank 1 exited"))
    assert outputs[1].details[0].finish_reason == FinishReason.ERROR
    assert engine.is_failed and engine.suspension is None


def test_a_resubmitted_request_continues_after_its_outputs() -> None:
    """A frontend resubmits a request to a restarted core with the tokens it already has."""
    expected = undisturbed(max_tokens=10).tokens[(1, 3)]
    engine, executor = make_engine()
    engine.add_request(
        make_request(3, PROMPTS[3], max_tokens=10, ignore_eos=True, output_token_ids=expected[:4])
    )
    view = run_to_completion(engine)
    assert view.tokens[(1, 3)] == expected[4:]  # only new tokens come back
    assert view.finished[(1, 3)] == FinishReason.LENGTH  # max_tokens counted the old ones
    (new,) = executor.seen[0].scheduled_new_reqs
    assert new.output_token_ids == expected[:4] and new.num_computed_tokens == 0


def test_min_tokens_counts_the_resubmitted_outputs() -> None:
    stop = default_token_fn("req-1-1", 2)
    engine, _ = make_engine()
    engine.add_request(
        make_request(1, [1, 2, 3], max_tokens=10, min_tokens=2, stop_token_ids=(stop,),
                     output_token_ids=[default_token_fn("req-1-1", i) for i in range(2)])
    )  # fmt: skip
    view = run_to_completion(engine)
    assert view.tokens[(1, 1)] == [stop] and view.finished[(1, 1)] == FinishReason.STOP


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [([5000], "outside the vocabulary"), ([7] * 4, "nothing is left to generate")],
)
def test_resubmitted_outputs_are_checked(outputs: list[int], problem: str) -> None:
    engine, executor = make_engine(vocab_size=1200)
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=4, output_token_ids=outputs))
    (detail,) = engine.step()[1].details
    assert detail.error_kind == ErrorKind.INVALID_REQUEST and problem in detail.error_message
    assert not executor.seen


class Recorder:
    """The loop's sinks: outputs by client, suspensions and failures, each with an event."""

    def __init__(self) -> None:
        self.view = ClientView()
        self.suspended: queue.Queue[Fault] = queue.Queue()
        self.failed: queue.Queue[str] = queue.Queue()
        self.lock = threading.Lock()
        self.last: EngineCoreOutputs | None = None

    def deliver(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        with self.lock:
            self.view.absorb({client_id: outputs})
            self.last = outputs


def start_proc(engine: EngineCore, recorder: Recorder) -> EngineCoreProc:
    proc = EngineCoreProc(
        engine,
        EngineInbox(),
        recorder.deliver,
        on_stats=lambda stats, seconds: None,
        on_failed=recorder.failed.put,
        on_suspended=lambda fault, num_requests: recorder.suspended.put(fault),
    )
    proc.start()
    return proc


class BlockingExecutor(FakeExecutor):
    """Holds step `hold_at` until released (a step in flight when the rank dies)."""

    def __init__(self, *args: Any, hold_at: int) -> None:
        super().__init__(*args)
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release = threading.Event()

    def execute_model(self, scheduler_output: Any) -> Any:
        if scheduler_output.step_id == self.hold_at:
            self.holding.set()
            assert self.release.wait(GUARD_S)
        return super().execute_model(scheduler_output)


def test_the_loop_suspends_once_resumes_and_ignores_the_old_ranks() -> None:
    engine, _ = make_engine(max_num_seqs=4, num_blocks=24, can_recover=True)
    old = engine.executor = BlockingExecutor(4, 24, hold_at=4)
    old.fail_at_step = 4
    recorder = Recorder()
    proc = start_proc(engine, recorder)
    try:
        proc.inbox.add_requests(1, [make_request(h, p, max_tokens=12, ignore_eos=True)
                              for h, p in PROMPTS.items()])  # fmt: skip
        assert old.holding.wait(GUARD_S)  # step 4 is in flight when the rank dies
        proc.inbox.executor_failed(old, "rank 1 is unreachable", "rank_died")
        proc.inbox.abort_requests(1, [8])
        old.release.set()
        fault = recorder.suspended.get(timeout=GUARD_S)
        assert fault.cause == "rank_died"
        proc.inbox.executor_failed(old, "rank 0 closed its stream", "rank_died")  # stale: ignored
        new = FakeExecutor(4, 24)
        assert proc.inbox.resume(new, 24).result(GUARD_S) == len(PROMPTS) - 1
        proc.inbox.executor_failed(old, "late news from the old ranks", "rank_died")  # ignored
        proc.inbox.add_requests(1, [make_request(30, [3, 4], max_tokens=2, ignore_eos=True)])
        deadline = threading.Event()
        while len(recorder.view.finished) < len(PROMPTS) and not deadline.wait(0.01):
            pass
        assert recorder.suspended.empty() and recorder.failed.empty()
    finally:
        proc.stop(GUARD_S)
    expected = undisturbed().tokens
    del expected[(1, 8)]
    got = {k: v for k, v in recorder.view.tokens.items() if k != (1, 8) and k != (1, 30)}
    assert got == expected and recorder.view.finished[(1, 30)] == FinishReason.LENGTH


def test_giving_up_fails_every_request_with_an_engine_failure() -> None:
    engine, _ = make_engine(can_recover=True)
    recorder = Recorder()
    proc = start_proc(engine, recorder)
    try:
        proc.inbox.add_requests(1, [make_request(1, [1, 2, 3], max_tokens=200, ignore_eos=True)])
        proc.inbox.executor_failed(engine.executor, "rank 0 exited", "rank_died")
        assert recorder.suspended.get(timeout=GUARD_S).message.endswith("rank 0 exited")
        proc.inbox.give_up("the worker ranks did not come back within 2 s")
        assert "did not come back" in recorder.failed.get(timeout=GUARD_S)
        assert (
            proc.inbox.resume(FakeExecutor(4, 64), 64).result(GUARD_S) is None
        )  # too late: refused
    finally:
        proc.stop(GUARD_S)
    assert recorder.view.finished == {(1, 1): FinishReason.ERROR}
    (detail,) = recorder.view.details[(1, 1)]
    assert detail.error_kind == ErrorKind.ENGINE_FAILURE
    assert recorder.last is not None and recorder.last.scheduler_stats is not None
    assert recorder.last.scheduler_stats.num_running_reqs == 0  # the frontend's gauges too
    assert engine.is_failed and engine.make_stats().num_used_blocks == 0
    assert engine.scheduler.requests == {} and engine.client_requests == {}


class SteppingExecutor(FakeExecutor):
    """A FakeExecutor that says, as GrpcExecutor does, whether a step ran on it."""

    @property
    def has_stepped(self) -> bool:
        return bool(self.seen)


def test_the_first_step_after_a_recovery_gets_only_the_rest_of_the_bound() -> None:
    """A fresh start's first step may take --execute-timeout (300 s); after a recovery that
    allowance would outlast --max-recovery-seconds. The new ranks' first step gets what is left
    of the bound, counted from the fault (here 2 s, of which the bring-up took 0.5)."""
    from prometheus_client import CollectorRegistry

    from core_svc.config import parse_config
    from core_svc.metrics import CoreMetrics
    from core_svc.recovery import RankRecovery
    from core_svc.worker_pool import ModelFacts

    engine, _ = make_engine(num_blocks=24, can_recover=True)
    engine.executor = old = SteppingExecutor(4, 24)
    recorder = Recorder()
    proc = start_proc(engine, recorder)
    facts = ModelFacts("LlamaForCausalLM", 2048, 256, "float32", "torch", 24, 1 << 20)
    config = parse_config(
        ["--worker-addrs", "127.0.0.1:1", "--max-recovery-seconds", "2", "--execute-timeout", "300"]
    )
    allowances: list[float | None] = []

    class Pool:
        def next_epoch(self) -> None:
            pass

        async def bring_up_with_retries(self, *args: Any) -> ModelFacts:
            await asyncio.sleep(0.5)
            return facts

    class Recovery(RankRecovery):
        def open_executor(self, first_step_seconds: float | None = None) -> Any:
            allowances.append(first_step_seconds)
            return old if len(allowances) == 1 else SteppingExecutor(4, 24)

    async def set_ready(is_ready: bool) -> None:
        pass

    async def scenario() -> None:
        metrics = CoreMetrics(CollectorRegistry(), "m", "0", {"engine": "0"})
        recovery = Recovery(config, Pool(), proc.inbox, metrics, facts, set_ready)  # type: ignore[arg-type]
        proc.inbox.add_requests(1, [make_request(1, [1, 2, 3], max_tokens=4, ignore_eos=True)])
        proc.inbox.executor_failed(old, "rank 0 exited", "rank_died")
        recovery.start(await asyncio.to_thread(recorder.suspended.get, timeout=GUARD_S), 1)
        while recovery.is_recovering:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        proc.stop(GUARD_S)
    first, allowance = allowances
    assert first is None  # the first start: --execute-timeout
    assert allowance is not None and 1.0 < allowance <= 1.5, allowance
