"""Tracing across the three services (--otlp-traces-endpoint) into a real OTLP/gRPC receiver
(tests/fixtures/otlp_collector.py): one trace per request under the client's `traceparent`
(HTTP header, gRPC metadata), frontend llm_request (vLLM's gen_ai attributes) with tokenize and
detokenize, core.request with its waiting and running spans, the output rank's worker.request;
and the same trace through a worker restart. The torch profiler (--profiler-config) on the same
stack: /start_profile and /stop_profile leave a trace file per rank."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import text_request
from tests.e2e.stack import Stack
from tests.fixtures.otlp_collector import OtlpCollector, ReceivedSpan

pytestmark = pytest.mark.slow
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def traced(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, OtlpCollector, Path]]:
    collector = OtlpCollector().start()
    profiles = tmp_path_factory.mktemp("profiles")
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(profiles)})
    flags = ["--otlp-traces-endpoint", collector.endpoint, "--collect-detailed-traces", "all"]
    flags += ["--profiler-config", profiler]
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export batches every 0.2 s (the services')
    stack = Stack(
        tiny_model_dir,
        core_flags=flags,
        frontend_flags=flags,
        worker_flags=flags,
        supervise=True,
        max_recovery_seconds=60.0,
    )
    try:
        stack.start()
        yield stack, collector, profiles
    finally:
        stack.stop()
        collector.stop()
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def is_complete(spans: list[ReceivedSpan]) -> bool:
    names = {s.name for s in spans}
    return {"llm_request", "core.request", "worker.request", "detokenize"} <= names


def test_one_trace_spans_the_three_services(traced: tuple[Stack, OtlpCollector, Path]) -> None:
    stack, collector, _ = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.5})
    request = urllib.request.Request(
        f"{stack.http}/v1/completions",
        body.encode(),
        {"content-type": "application/json", "traceparent": traceparent(trace_id)},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 6
    spans = collector.wait_for(trace_id, is_complete)
    (llm,) = named(spans, "llm_request")
    assert llm.parent_span_id == CLIENT_SPAN and llm.kind == 2  # SPAN_KIND_SERVER
    assert llm.resource["service.name"] == "splitserve-frontend"
    assert llm.attributes["gen_ai.usage.completion_tokens"] == 6
    assert llm.attributes["gen_ai.usage.prompt_tokens"] > 0
    assert llm.attributes["gen_ai.request.temperature"] == 0.5
    assert llm.attributes["gen_ai.request.max_tokens"] == 6
    for key in ("gen_ai.latency.e2e", "gen_ai.latency.time_to_first_token",
                "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_decode"):  # fmt: skip
        assert llm.attributes[key] >= 0, key
    for child in ("tokenize", "detokenize"):
        assert named(spans, child)[0].parent_span_id == llm.span_id, child
    (core,) = named(spans, "core.request")
    assert core.parent_span_id == llm.span_id
    assert core.resource["service.name"] == "splitserve-core"
    assert core.attributes["gen_ai.usage.completion_tokens"] == 6
    assert core.attributes["splitserve.status"].startswith("FINISHED_LENGTH")
    for child in ("core.waiting", "core.running"):
        assert named(spans, child)[0].parent_span_id == core.span_id, child
    (worker,) = named(spans, "worker.request")
    assert worker.parent_span_id == core.span_id
    assert worker.resource["service.name"] == "splitserve-worker"
    assert worker.attributes["splitserve.prefill_steps"] >= 1
    assert worker.attributes["splitserve.decode_steps"] >= 5
    assert worker.attributes["gen_ai.latency.time_in_model_forward"] > 0
    assert llm.start_ns <= core.start_ns <= worker.start_ns <= worker.end_ns <= llm.end_ns


def test_the_trace_survives_a_worker_restart(traced: tuple[Stack, OtlpCollector, Path]) -> None:
    stack, collector, _ = traced
    trace_id = "5b8efff798038103d269b633813fc60c"
    rank = stack.child("worker[0]")
    old = rank.process
    tokens: list[int] = []
    with grpc.insecure_channel(stack.frontend) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        call = stub.Generate(
            text_request("a long story", max_tokens=400, ignore_eos=True),
            timeout=180,
            metadata=[("traceparent", traceparent(trace_id))],
        )
        killed = threading.Event()
        for response in call:
            tokens += list(response.token_ids)
            if len(tokens) >= 20 and not killed.is_set():
                old.send_signal(signal.SIGKILL)  # a rank this test started, by PID
                killed.set()
    assert len(tokens) == 400 and killed.is_set()
    deadline = time.monotonic() + 60
    while rank.process is old and time.monotonic() < deadline:
        time.sleep(0.2)
    new_pid = str(rank.process.pid)

    def has_new_worker(spans: list[ReceivedSpan]) -> bool:
        workers = named(spans, "worker.request")
        return is_complete(spans) and any(w.resource["vllm.process_id"] == new_pid for w in workers)

    spans = collector.wait_for(trace_id, has_new_worker)
    (llm,) = named(spans, "llm_request")
    (core,) = named(spans, "core.request")
    assert core.parent_span_id == llm.span_id and llm.parent_span_id == CLIENT_SPAN
    assert core.attributes["splitserve.num_recoveries"] >= 1
    assert llm.attributes["gen_ai.usage.completion_tokens"] == 400
    workers = named(spans, "worker.request")
    assert [w.resource["vllm.process_id"] for w in workers] == [new_pid]  # the old one died
    assert workers[0].parent_span_id == core.span_id


def test_start_and_stop_profile_write_a_trace_per_rank(
    traced: tuple[Stack, OtlpCollector, Path],
) -> None:
    stack, _, profiles = traced

    def post(path: str, body: bytes = b"") -> int:
        request = urllib.request.Request(f"{stack.http}{path}", body, method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            return int(reply.status)

    assert post("/start_profile", json.dumps({"profile_prefix": "e2e"}).encode()) == 200
    with grpc.insecure_channel(stack.frontend) as channel:
        for _ in gen_grpc.GenerationServiceStub(channel).Generate(
            text_request("profile me", max_tokens=4), timeout=60
        ):
            pass
    assert post("/stop_profile") == 200
    deadline = time.monotonic() + 60
    found: list[Path] = []
    while not found and time.monotonic() < deadline:
        time.sleep(0.5)
        found = list(profiles.glob("e2e_rank0*.pt.trace.json*"))
    assert found, sorted(profiles.iterdir())
