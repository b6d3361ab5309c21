"""Three frontends on one engine core (what the chart's frontend HPA and KEDA scaling rely on):
requests interleaved over all three, on gRPC and HTTP, each answered correctly, and the
counters consistent - every frontend counts exactly what it served, they add up to what was
sent, and the core's own counts agree."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.children import Child, stop_children
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import join
from tests.e2e.stack import Stack
from tests.e2e.test_generate import hf_greedy

pytestmark = pytest.mark.slow
NUM_FRONTENDS = 3
PER_FRONTEND = 8  # half over gRPC, half over HTTP
WORDS = ["river", "stone", "light", "token", "engine", "quiet", "north", "amber"]


@dataclass(frozen=True)
class Job:
    frontend: int
    transport: str  # "grpc" or "http"
    prompt: str
    max_tokens: int


@dataclass
class Answer:
    text: str
    token_ids: list[int] | None  # gRPC only
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def jobs() -> list[Job]:
    """Round-robin over the frontends, so consecutive requests hit different ones; some
    prompts repeat across frontends (prefix-cache hits on the shared core when the first
    one's prefill is done by the time the next is scheduled)."""
    out = []
    for i in range(NUM_FRONTENDS * PER_FRONTEND):
        frontend, k = i % NUM_FRONTENDS, i // NUM_FRONTENDS
        prompt = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(3 + 5 * (k % 4)))
        out.append(Job(frontend, ("grpc", "http")[k % 2], prompt, 4 + (i * 5) % 13))
    return out


def repeats(work: list[Job]) -> list[Job]:
    """A second round, once the first is done: its longest prompts (a full KV block and more)
    again, each on another frontend than before, so that prefix-cache hits across frontends
    happen whatever the timing of the first round was."""
    longest = max(len(j.prompt) for j in work)
    again = [j for j in work if len(j.prompt) == longest][:NUM_FRONTENDS]
    return [dataclasses.replace(j, frontend=(j.frontend + 1) % NUM_FRONTENDS) for j in again]


@pytest.fixture(scope="module")
def frontends(tiny_model_dir: Path) -> Iterator[tuple[Stack, list[Child]]]:
    stack = Stack(tiny_model_dir).start()
    extra: list[Child] = []
    try:
        extra = [stack.add_frontend() for _ in range(NUM_FRONTENDS - 1)]
        yield stack, [stack.child("frontend"), *extra]
    finally:
        stop_children(extra)
        stack.stop()


async def via_grpc(channel: grpc.aio.Channel, job: Job) -> Answer:
    params = types_pb2.SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
    stub = gen_grpc.GenerationServiceStub(channel)
    request = gen_pb2.GenerateRequest(prompt=job.prompt, sampling_params=params)
    done = join([r async for r in stub.Generate(request, timeout=120)])[0]
    reason = types_pb2.FinishReason.Name(done.finish_reason)
    return Answer(
        done.text,
        done.token_ids,
        done.usage.prompt_tokens,
        done.usage.completion_tokens,
        reason.removeprefix("FINISH_REASON_").lower(),
    )


async def via_http(session: aiohttp.ClientSession, base: str, job: Job) -> Answer:
    body = {
        "model": "tiny-llama-v1",
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, reason, usage = "", "", {}
    async with session.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    return Answer(text, None, usage["prompt_tokens"], usage["completion_tokens"], reason)


async def run_interleaved(children: list[Child], work: list[Job]) -> list[Answer]:
    channels = [grpc.aio.insecure_channel(c.address) for c in children]
    try:
        async with aiohttp.ClientSession() as session:

            async def one(i: int, job: Job) -> Answer:
                await asyncio.sleep(0.02 * i)  # staggered: they overlap and batch together
                if job.transport == "grpc":
                    return await via_grpc(channels[job.frontend], job)
                base = f"http://{children[job.frontend].http_address}"
                return await via_http(session, base, job)

            return list(await asyncio.gather(*(one(i, j) for i, j in enumerate(work))))
    finally:
        for channel in channels:
            await channel.close()


def series(name: str, **labels: str) -> str:
    """The key `scrape` files a labelled sample under (with model_name tiny-llama-v1)."""
    labels = {"model_name": "tiny-llama-v1", **labels}
    return f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, summed over label sets under the bare name too."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            values[series(sample.name, **sample.labels)] = sample.value
    return values


def settled(urls: list[str], check: Any, timeout: float = 15.0) -> list[dict[str, float]]:
    """Scrapes of `urls` once `check(scrapes)` holds (counters land just after the last
    token goes out); the last scrapes when it never does, for the assertion to report."""
    deadline = time.monotonic() + timeout
    while True:
        scrapes = [scrape(u) for u in urls]
        if check(scrapes) or time.monotonic() > deadline:
            return scrapes
        time.sleep(0.2)


@pytest.mark.extended  # make test: three frontends' counts in tests/metrics/test_metrics_sum.py
def test_three_frontends_interleaved_are_correct_and_counted_consistently(
    frontends: tuple[Stack, list[Child]], hf_model: Any, tokenizer: Any
) -> None:
    stack, children = frontends
    assert len({c.address for c in children}) == NUM_FRONTENDS
    work = jobs()
    answers = asyncio.run(run_interleaved(children, work))
    second = repeats(work)
    work, answers = work + second, answers + asyncio.run(run_interleaved(children, second))

    # Every request correct: greedy equals transformers', whichever frontend and transport.
    for job, answer in zip(work, answers, strict=True):
        prompt_ids = tokenizer.encode(job.prompt)
        expected = hf_greedy(hf_model, prompt_ids, job.max_tokens)
        if answer.token_ids is not None:
            assert answer.token_ids == expected, job
        assert answer.text == tokenizer.decode(expected, skip_special_tokens=True), job
        assert (answer.prompt_tokens, answer.completion_tokens) == (len(prompt_ids), len(expected))
        assert answer.finish_reason == "length", job

    # Each frontend counts what it served; together, everything that was sent.
    served = [
        [a for j, a in zip(work, answers, strict=True) if j.frontend == f]
        for f in range(NUM_FRONTENDS)
    ]
    expected_counts = [
        (len(mine), sum(a.prompt_tokens for a in mine), sum(a.completion_tokens for a in mine))
        for mine in served
    ]

    def counts(sample: dict[str, float]) -> tuple[int, int, int]:
        return (
            int(sample.get("vllm:request_success_total", 0)),
            int(sample.get("vllm:prompt_tokens_total", 0)),
            int(sample.get("vllm:generation_tokens_total", 0)),
        )

    scrapes = settled(
        [c.metrics_url for c in children],
        lambda s: [counts(x) for x in s] == expected_counts,
    )
    assert [counts(x) for x in scrapes] == expected_counts
    assert sum(int(x["vllm:request_success_total"]) for x in scrapes) == len(work)
    length = series("vllm:request_success_total", finished_reason="length", engine="0")
    for sample in scrapes:  # all of them finished by length, all counted for engine 0
        assert sample[length] == sample["vllm:request_success_total"]

    # The core's view agrees: it saw every prompt token once (no preemption) and scheduled
    # exactly prompt - cached + generated - 1 per request (the last sampled token is never fed).
    core = scrape(stack.child("core").metrics_url)
    total_prompt = sum(c[1] for c in expected_counts)
    total_generated = sum(c[2] for c in expected_counts)
    assert core["vllm:num_preemptions_total"] == 0
    assert core["vllm:prefix_cache_queries_total"] == total_prompt
    hits = core["vllm:prefix_cache_hits_total"]
    assert 0 < hits < total_prompt  # repeated prompts hit across frontends (the second round)
    scheduled = total_prompt - hits + total_generated - len(work)
    assert core["vllm:iteration_tokens_total_sum"] == scheduled
    assert core["splitserve_core_frontend_streams"] == NUM_FRONTENDS
    stats = stack.scheduler_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)

    # Every frontend's HTTP port exports the engine's gauges, and they tell the truth there
    # too: idle now, whichever frontend's requests ended last (a frontend whose last outputs
    # came while the others' requests ran asks the core afresh, within about a second).
    def idle(scrapes: list[dict[str, float]]) -> bool:
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        return all(x[n] == 0 for x in scrapes for n in names)

    urls = [f"http://{c.http_address}/metrics" for c in children]
    engines = settled(urls, idle, timeout=10.0)
    assert idle(engines), [
        (x["vllm:num_requests_running"], x["vllm:num_requests_waiting"]) for x in engines
    ]
    assert {x["vllm:kv_cache_usage_perc"] for x in engines} == {0.0}
