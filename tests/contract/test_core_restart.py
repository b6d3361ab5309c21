"""A frontend whose engine core restarts at the same address: the requests in flight pause, are
resubmitted with the tokens they have, and finish as if nothing happened; past the bound they
fail; a client that leaves during the pause is not resubmitted. A real loopback gRPC core (the
FakeExecutor samples a pure function of request id and output index) and the real client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.core_client import EngineCoreClient
from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.errors import EngineUnavailable
from frontend_svc.requests import CompletionDelta
from splitserve_contracts.output_types import FinishReason
from tests.contract.test_core_service import (
    CoreHarness,
    collect,
    frontend_metrics,
    request,
    run,
    tokens,
)
from tests.unit.core.fake_executor import default_token_fn

NUM_STREAMS, MAX_TOKENS = 8, 24


async def frontend(addr: str, tokenizer: Any, max_recovery_seconds: float) -> AsyncEngine:
    client = EngineCoreClient(addr)
    await client.connect(timeout=10)
    metrics = frontend_metrics()
    processor = OutputProcessor(backend_decoder(tokenizer), metrics)
    engine = AsyncEngine(client, processor, metrics, max_recovery_seconds=max_recovery_seconds)
    engine.start()
    return engine


def resubmitted(engine: AsyncEngine) -> float:
    return float(engine.metrics.resubmitted._value.get())


async def started_streams(
    engine: AsyncEngine, count: int, one_by_one: bool = False
) -> list[asyncio.Task[Any]]:
    """`count` streams, each past its first tokens (`one_by_one`: each running before the next
    is added, as a core with a small queue limit admits them)."""
    firsts = [asyncio.Event() for _ in range(count)]

    async def consume(i: int) -> list[CompletionDelta]:
        deltas = []
        async for delta in engine.generate(request(f"r{i}", max_tokens=MAX_TOKENS)):
            deltas.append(delta)
            firsts[i].set()
        return deltas

    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(consume(i)))
        if one_by_one:
            await firsts[i].wait()
    await asyncio.gather(*(first.wait() for first in firsts))
    return tasks


def test_a_restarted_core_finishes_the_requests_in_flight(tokenizer: Any) -> None:
    async def scenario() -> None:
        core = await CoreHarness(step_delay=0.01).__aenter__()
        engine = await frontend(core.addr, tokenizer, max_recovery_seconds=30)
        tasks = await started_streams(engine, NUM_STREAMS)
        await core.__aexit__()
        assert not any(task.done() for task in tasks)  # paused, not failed
        restarted = await CoreHarness(port=core.port).__aenter__()
        try:
            for i, task in enumerate(tasks):
                deltas = await task
                assert tokens(deltas) == [default_token_fn(f"r{i}", j) for j in range(MAX_TOKENS)]
                assert deltas[-1].finish_reason == FinishReason.LENGTH
                assert deltas[-1].completion_tokens == MAX_TOKENS
            assert resubmitted(engine) == NUM_STREAMS
            resumed = restarted.executor.seen[0].scheduled_new_reqs
            assert all(new.output_token_ids for new in resumed)  # none started over
            assert (await restarted.wait_idle()).kv_cache_usage == 0.0
            after = await collect(engine.generate(request("after", max_tokens=3)))
            assert tokens(after) == [default_token_fn("after", j) for j in range(3)]
        finally:
            await engine.close()
            await restarted.__aexit__()

    run(scenario)


def test_resubmissions_are_not_refused_by_the_restarted_cores_queue_limits(
    tokenizer: Any,
) -> None:
    """--max-num-queued-reqs 2 on both cores: the 4 requests running when the core died were
    admitted once; resubmitted to its successor in one message, all 4 resume (none refused as
    overloaded)."""

    async def scenario() -> None:
        core = await CoreHarness(step_delay=0.01, max_num_queued_reqs=2).__aenter__()
        engine = await frontend(core.addr, tokenizer, max_recovery_seconds=30)
        tasks = await started_streams(engine, 4, one_by_one=True)
        await core.__aexit__()
        restarted = await CoreHarness(port=core.port, max_num_queued_reqs=2).__aenter__()
        try:
            for i, task in enumerate(tasks):
                deltas = await task
                assert deltas[-1].finish_reason == FinishReason.LENGTH, deltas[-1].error_message
                assert tokens(deltas) == [default_token_fn(f"r{i}", j) for j in range(MAX_TOKENS)]
            assert resubmitted(engine) == 4
            new = restarted.executor.seen[0].scheduled_new_reqs
            assert sorted(r.request_id for r in new) == ["r0", "r1", "r2", "r3"]
        finally:
            await engine.close()
            await restarted.__aexit__()

    run(scenario)


@pytest.mark.parametrize(
    ("field", "value"),
    [("served_model_name", "another"), ("vocab_size", 4096), ("max_model_len", 64)],
)
def test_a_core_that_comes_back_serving_something_else_fails_the_paused_requests(
    tokenizer: Any, field: str, value: object
) -> None:
    """The requests' tokens mean nothing to another model (or vocabulary, or context length):
    they fail at once, naming the change, and none is resubmitted; new requests are served."""

    async def scenario() -> None:
        core = await CoreHarness(step_delay=0.01).__aenter__()
        engine = await frontend(core.addr, tokenizer, max_recovery_seconds=30)
        (task,) = await started_streams(engine, 1)
        await core.__aexit__()
        restarted = await CoreHarness(port=core.port, info={field: value}).__aenter__()
        try:
            with pytest.raises(EngineUnavailable) as failed:
                await task
            assert f"now reports {field} {value!r}" in failed.value.detail
            assert resubmitted(engine) == 0 and engine.num_running == 0
            after = await collect(engine.generate(request("after", max_tokens=3)))
            assert tokens(after) == [default_token_fn("after", j) for j in range(3)]
            assert [r.request_id for r in restarted.executor.seen[0].scheduled_new_reqs] == [
                "after"
            ]
        finally:
            await engine.close()
            await restarted.__aexit__()

    run(scenario)


def test_past_the_bound_the_paused_requests_fail(tokenizer: Any) -> None:
    async def scenario() -> None:
        core = await CoreHarness(step_delay=0.01).__aenter__()
        engine = await frontend(core.addr, tokenizer, max_recovery_seconds=0.3)
        (task,) = await started_streams(engine, 1)
        await core.__aexit__()
        with pytest.raises(EngineUnavailable, match="lost the engine core"):
            await task
        assert engine.num_running == 0 and resubmitted(engine) == 0
        await engine.close()

    run(scenario)


def test_a_client_that_leaves_during_the_pause_is_not_resubmitted(tokenizer: Any) -> None:
    async def scenario() -> None:
        core = await CoreHarness(step_delay=0.01).__aenter__()
        engine = await frontend(core.addr, tokenizer, max_recovery_seconds=30)
        staying, leaving = await started_streams(engine, 2)
        await core.__aexit__()
        leaving.cancel()
        await asyncio.wait([leaving])
        assert engine.num_running == 1
        restarted = await CoreHarness(port=core.port).__aenter__()
        try:
            assert tokens(await staying) == [default_token_fn("r0", j) for j in range(MAX_TOKENS)]
            assert resubmitted(engine) == 1
            assert [new.request_id for new in restarted.executor.seen[0].scheduled_new_reqs] == [
                "r0"
            ]
            assert (await restarted.wait_idle()).num_running_reqs == 0
        finally:
            await engine.close()
            await restarted.__aexit__()

    run(scenario)
