"""A frontend whose engine core restarts at the same address: the requests in flight pause, are
resubmitted with the tokens they have, and finish as if nothing happened; past the bound they
fail; a client that leaves during the pause is not resubmitted. A real loopback gRPC core (the
FakeExecutor samples a pure function of request id and output index) and the real client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from frontend_svc.async_engine import AsyncEngine
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.detokenizer import backend_decoder
from frontend_svc.errors import EngineUnavailable
from frontend_svc.output_processor import OutputProcessor
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


async def started_streams(engine: AsyncEngine, count: int) -> list[asyncio.Task[Any]]:
    """`count` streams, each past its first tokens."""
    firsts = [asyncio.Event() for _ in range(count)]

    async def consume(i: int) -> list[CompletionDelta]:
        deltas = []
        async for delta in engine.generate(request(f"r{i}", max_tokens=MAX_TOKENS)):
            deltas.append(delta)
            firsts[i].set()
        return deltas

    tasks = [asyncio.create_task(consume(i)) for i in range(count)]
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
