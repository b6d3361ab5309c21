"""--async-scheduling over real processes: the core schedules step N+1 while the ranks run step
N, and the ranks feed their own sampled tokens to the next step. A crowd of greedy and seeded
requests (some stopped by a stop token, so a step runs past the stop and its token is dropped)
gives, at TP=1 and TP=2, exactly the outputs of the same stack in lockstep; a rank killed under
load is restarted and every request resumes with the steps in flight recomputed."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from tests.e2e.client import Completion
from tests.e2e.stack import Stack
from tests.e2e.test_generate import _run_all
from tests.e2e.test_recovery import (
    CORE_FLAGS,
    Streams,
    assert_resumed,
    core_serving,
    metric,
    run_streams,
    wait_idle,
    wait_until,
)

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32"]
Outputs = list[dict[int, tuple[list[int], int]]]


def _request(i: int, rng: random.Random) -> gen_pb2.GenerateRequest:
    words = " ".join(
        rng.choice(["river", "stone", "light", "quiet"]) for _ in range(rng.randint(1, 40))
    )
    params = types_pb2.SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True)
    if i % 3:
        params.temperature = 0.0
    else:
        params.temperature, params.seed = 0.9, 500 + i
    return gen_pb2.GenerateRequest(request_id=f"r{i}", prompt=words, sampling_params=params)


def _with_stop(request: gen_pb2.GenerateRequest, token_id: int) -> gen_pb2.GenerateRequest:
    stopped = gen_pb2.GenerateRequest()
    stopped.CopyFrom(request)
    stopped.request_id += "-stop"
    stopped.sampling_params.stop_token_ids.append(token_id)
    return stopped


def _outputs(results: list[dict[int, Completion]]) -> Outputs:
    return [{k: (c.token_ids, c.finish_reason) for k, c in r.items()} for r in results]


@pytest.fixture(scope="module")
def lockstep(tiny_model_dir: Path) -> Iterator[tuple[list[gen_pb2.GenerateRequest], Outputs]]:
    """The requests and what a TP=1 stack in lockstep (--no-async-scheduling) answers to them."""
    rng = random.Random(11)
    requests = [_request(i, rng) for i in range(24)]
    stack = Stack(tiny_model_dir, core_flags=[*FLAGS, "--no-async-scheduling"]).start()
    try:
        first = _outputs(asyncio.run(_run_all(stack.frontend, requests)))
        greedy_long = [
            i for i, r in enumerate(requests) if i % 3 and r.sampling_params.max_tokens > 8
        ]
        stops = [_with_stop(requests[i], first[i][0][0][5]) for i in greedy_long[:6]]
        requests += stops
        outputs = first + _outputs(asyncio.run(_run_all(stack.frontend, stops)))
    finally:
        stack.stop()
    assert any(o[0][1] == types_pb2.FINISH_REASON_STOP for o in outputs[24:])
    yield requests, outputs


@pytest.mark.parametrize("tp", [1, 2])
def test_async_scheduling_gives_the_outputs_of_lockstep(
    tiny_model_dir: Path, lockstep: tuple[list[gen_pb2.GenerateRequest], Outputs], tp: int
) -> None:
    requests, expected = lockstep
    stack = Stack(tiny_model_dir, tp=tp, core_flags=[*FLAGS, "--async-scheduling"]).start()
    try:
        got = _outputs(asyncio.run(_run_all(stack.frontend, requests)))
        for request, want, have in zip(requests, expected, got, strict=True):
            assert have == want, request.request_id
        wait_idle(stack)  # what ran past a stop was freed
    finally:
        stack.stop()


@pytest.mark.extended
def test_a_killed_or_hung_rank_resumes_every_request_with_async_scheduling(
    tiny_model_dir: Path,
) -> None:
    """SIGKILL (the rank is restarted), then SIGSTOP (the step watchdog, whose clock starts
    when the step before answered, finds the rank hung; SIGCONT brings it back). Extended:
    async scheduling is on by default, so make test's tests/e2e/test_recovery.py (a killed
    and a stopped rank at TP=2) covers the same ground."""
    flags = [*CORE_FLAGS, "--async-scheduling"]
    stack = Stack(tiny_model_dir, tp=2, core_flags=flags, supervise=True).start()
    try:
        undisturbed = run_streams(stack.frontend)
        assert not undisturbed.errors
        rank, core = stack.child("worker[1]"), stack.child("core")
        old = rank.process
        streams = run_streams(stack.frontend, lambda s: old.send_signal(signal.SIGKILL))
        assert_resumed(streams, undisturbed.tokens)
        assert rank.process is not old and core.process.poll() is None
        wait_idle(stack)

        hung = metric(core, "splitserve_engine_recoveries_total", cause="rank_hung")
        pid = stack.child("worker[0]").process.pid

        def pause(streams: Streams) -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: not core_serving(stack), 120, "the stopped rank was not noticed")
            finally:
                os.kill(pid, signal.SIGCONT)

        assert_resumed(run_streams(stack.frontend, pause), undisturbed.tokens)
        assert metric(core, "splitserve_engine_recoveries_total", cause="rank_hung") >= hung + 1
        wait_idle(stack)
    finally:
        stack.stop()


def test_the_in_process_llm_gives_the_same_outputs_with_async_scheduling(
    tiny_model_dir: Path,
) -> None:
    from splitserve import LLM, SamplingParams

    prompts = ["The quick brown fox", "one two", "river stone light " * 6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, n=2),
    ]
    outputs = []
    for is_async in (False, True):
        with LLM(
            str(tiny_model_dir), kv_cache_memory_bytes=64 << 20, async_scheduling=is_async
        ) as llm:
            outputs.append(
                [[o.token_ids for o in r.outputs] for p in params for r in llm.generate(prompts, p)]
            )
    assert outputs[0] == outputs[1]
