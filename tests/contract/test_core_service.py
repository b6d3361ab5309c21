"""EngineCoreService over a real loopback gRPC server, driven by the real frontend client.

The core runs its real servicer, busy loop, scheduler and KV cache manager; only the workers are
replaced by the scripted FakeExecutor (tokens are a pure function of request id and position).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.metrics import CoreMetrics
from core_svc.server import ClientStreams, EngineCoreServicer
from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.core_client import EngineCoreClient, RoundTrip
from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.errors import EngineUnavailable
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.output_types import FinishReason
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.rpc_guard import AioRpcGuard, GuardPolicy, secret_admission
from splitserve_runtime.services import CORE
from tests.unit.core.fake_executor import default_token_fn, make_engine

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 64, 4, 128
PROMPT = [5, 6, 7, 8, 9, 10]


class CoreHarness:
    """A core service on an ephemeral loopback port with a FakeExecutor behind it."""

    def __init__(
        self,
        step_delay: float = 0.0,
        port: int = 0,
        info: dict[str, Any] | None = None,
        secret: str = "",
        **limits: int,
    ) -> None:
        self.step_delay = step_delay
        self.port = port
        """0: any free port; a restarted core takes its predecessor's."""
        self.info = info or {}
        """EngineInfo fields the core reports other than the defaults (another model...)."""
        self.limits = limits
        """SchedulerConfig limits, e.g. max_num_queued_reqs."""
        self.secret = secret
        """The deployment's --internal-secret ("": none): the core admits only calls with it."""

    async def __aenter__(self) -> CoreHarness:
        loop = asyncio.get_running_loop()
        engine, self.executor = make_engine(
            NUM_BLOCKS,
            BLOCK_SIZE,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            max_model_len=MAX_LEN,
            **self.limits,
        )
        if self.step_delay:
            self.executor.on_execute = lambda so: time.sleep(self.step_delay)
        admissions = {CORE.grpc_service: secret_admission(self.secret)} if self.secret else {}
        self.server = grpc.aio.server(interceptors=[AioRpcGuard(GuardPolicy(admissions))])
        streams = ClientStreams(loop)
        metrics = CoreMetrics(CollectorRegistry(), "fake", "0", {"engine": "0"})
        self.proc = EngineCoreProc(
            engine,
            EngineInbox(),
            streams.deliver,
            on_stats=metrics.observe_stats,
            on_failed=lambda m: None,
        )
        info = core_pb2.EngineInfo(
            served_model_name="fake",
            max_model_len=MAX_LEN,
            vocab_size=2048,
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS,
            max_num_seqs=32,
        )
        info.MergeFrom(core_pb2.EngineInfo(**self.info))
        servicer = EngineCoreServicer(self.proc, streams, info, metrics)
        core_grpc.add_EngineCoreServiceServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.addr = f"127.0.0.1:{self.port}"
        self.proc.start()
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(0)
        await asyncio.to_thread(self.proc.stop, 5.0)

    async def stats(self) -> core_pb2.SchedulerStats:
        async with grpc.aio.insecure_channel(self.addr) as channel:
            reply = await core_grpc.EngineCoreServiceStub(channel).GetSchedulerStats(
                core_pb2.GetSchedulerStatsRequest()
            )
            return reply.scheduler_stats

    async def wait_idle(self, timeout: float = 10.0) -> core_pb2.SchedulerStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = await self.stats()
            idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
            if (idle and stats.kv_cache_usage == 0.0) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def frontend_metrics() -> FrontendMetrics:
    return FrontendMetrics(CollectorRegistry(), "fake", "0", MAX_LEN)


async def frontend(addr: str, tokenizer: Any) -> AsyncEngine:
    client = EngineCoreClient(addr)
    await client.connect(timeout=10)
    metrics = frontend_metrics()
    engine = AsyncEngine(client, OutputProcessor(backend_decoder(tokenizer), metrics), metrics)
    engine.start()
    return engine


def request(request_id: str, **params: Any) -> EngineRequest:
    params.setdefault("max_tokens", 5)
    return EngineRequest(request_id, PROMPT, SamplingParams(**params), eos_token_id=None)


async def collect(stream: AsyncIterator[CompletionDelta]) -> list[CompletionDelta]:
    return [delta async for delta in stream]


def tokens(deltas: list[CompletionDelta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


def test_a_stream_completes_with_the_requests_own_tokens(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness() as core:
            engine = await frontend(core.addr, tokenizer)
            deltas = await collect(engine.generate(request("alpha", max_tokens=7)))
            assert tokens(deltas) == [default_token_fn("alpha", i) for i in range(7)]
            assert deltas[-1].finish_reason == FinishReason.LENGTH
            assert deltas[-1].completion_tokens == 7 and deltas[-1].prompt_tokens == len(PROMPT)
            assert (await core.wait_idle()).kv_cache_usage == 0.0
            await engine.close()

    run(scenario)


def test_many_concurrent_requests_are_demultiplexed(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness() as core:
            engine = await frontend(core.addr, tokenizer)
            ids = [f"req{i}" for i in range(24)]
            results = await asyncio.gather(
                *(
                    collect(engine.generate(request(rid, max_tokens=3 + i % 5)))
                    for i, rid in enumerate(ids)
                )
            )
            for i, (rid, deltas) in enumerate(zip(ids, results, strict=True)):
                assert tokens(deltas) == [default_token_fn(rid, k) for k in range(3 + i % 5)]
            await engine.close()

    run(scenario)


def test_n_greater_than_one_fans_out_and_merges_by_index(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness() as core:
            engine = await frontend(core.addr, tokenizer)
            deltas = await collect(
                engine.generate(request("multi", n=3, temperature=1.0, seed=11, max_tokens=4))
            )
            for index in range(3):
                assert tokens(deltas, index) == [
                    default_token_fn(f"multi-{index}", k) for k in range(4)
                ]
            assert sum(d.is_finished for d in deltas) == 3
            await engine.close()

    run(scenario)


def test_cancelling_a_stream_aborts_it_and_frees_its_blocks(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness(step_delay=0.01) as core:
            engine = await frontend(core.addr, tokenizer)

            async def consume_two() -> None:
                count = 0
                async for _ in engine.generate(request("long", max_tokens=100)):
                    count += 1
                    if count == 2:
                        await asyncio.sleep(10)  # cancelled here, mid-stream

            task = asyncio.create_task(consume_two())
            await asyncio.sleep(0.3)
            running = await core.stats()
            assert running.num_running_reqs == 1 and running.kv_cache_usage > 0
            task.cancel()
            stats = await core.wait_idle()
            assert (stats.num_running_reqs, stats.kv_cache_usage) == (0, 0.0)
            await engine.close()

    run(scenario)


def test_a_closed_stream_aborts_all_of_its_requests(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness(step_delay=0.01) as core:
            async with grpc.aio.insecure_channel(core.addr) as channel:
                call = core_grpc.EngineCoreServiceStub(channel).EngineStream()
                reqs = [
                    core_pb2.EngineCoreRequest(
                        request_id=f"r{h}",
                        request_handle=h,
                        prompt_token_ids=PROMPT,
                        max_tokens=100,
                    )
                    for h in (1, 2, 3)
                ]
                await call.write(
                    core_pb2.EngineStreamRequest(add=core_pb2.AddRequests(requests=reqs))
                )
                first = await call.read()
                assert set(first.outputs.request_handles) <= {1, 2, 3}
                assert (await core.stats()).num_running_reqs == 3
                call.cancel()
            stats = await core.wait_idle()
            assert (stats.num_running_reqs, stats.kv_cache_usage) == (0, 0.0)

    run(scenario)


def test_requests_in_flight_end_unavailable_when_the_core_goes_away(tokenizer: Any) -> None:
    async def scenario() -> None:
        core = CoreHarness(step_delay=0.01)
        await core.__aenter__()
        engine = await frontend(core.addr, tokenizer)
        stream = engine.generate(request("doomed", max_tokens=1000))
        first = await stream.__anext__()
        assert first.token_ids
        await core.__aexit__()
        with pytest.raises(EngineUnavailable, match="lost the engine core"):
            await collect(stream)
        with pytest.raises(EngineUnavailable):
            await collect(engine.generate(request("later")))
        await engine.close()

    run(scenario)


def test_handshake_reports_the_engine_facts_and_pings_are_answered(tokenizer: Any) -> None:
    async def scenario() -> None:
        async with CoreHarness() as core:
            client = EngineCoreClient(core.addr, ping_interval=0.05)
            info = await client.connect(timeout=10)
            assert (info.max_model_len, info.options.cache.block_size, info.num_kv_blocks) == (
                MAX_LEN,
                BLOCK_SIZE,
                NUM_BLOCKS,
            )
            rtts = []
            while len(rtts) < 3:
                event = await asyncio.wait_for(client.next_event(), 5)
                client.event_done()
                if isinstance(event, RoundTrip):
                    rtts.append(event.seconds)
            assert all(0 < r < 5 for r in rtts)
            await client.close()

    run(scenario)
