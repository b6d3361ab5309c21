"""Metrics that add up: a real Prometheus scrapes a stack with three frontends on one engine
core as the chart's ServiceMonitor does (every service's metrics port), while requests wait in
the core. Every engine series has one source, so `sum(vllm:num_requests_waiting)` (what the
production-stack prom-adapter, KEDA examples and stat panels compute) is the core's truth, not
(frontends + 1) times it; each frontend's serving port still shows the engine series for
gateways; and the series vLLM has that were missing are there."""

from __future__ import annotations

import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.children import Child, stop_children
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import text_request
from tests.e2e.stack import Stack
from tests.metrics.prometheus_server import PrometheusServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed"),
]
MODEL = "sum-model"
SEL = f'{{model_name="{MODEL}"}}'
NUM_REQUESTS = 6
"""Long requests on a core that runs one at a time: the others wait."""


def drain(call: grpc.Future) -> None:
    try:
        for _ in call:  # type: ignore[attr-defined]
            pass
    except grpc.RpcError:
        pass  # cancelled at the end of the test


def serving_port_metrics(child: Child) -> dict[str, float]:
    """A frontend's serving port (/metrics of its HTTP API), as a gateway scrapes it."""
    with urllib.request.urlopen(f"http://{child.http_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name + (f"|{sample.labels['reason']}" if "reason" in sample.labels else ""): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, list[Child], PrometheusServer]]:
    core_flags = ["--served-model-name", MODEL, "--max-num-seqs", "1"]
    stack = Stack(tiny_model_dir, core_flags=core_flags).start()
    extra: list[Child] = []
    prometheus = None
    try:
        extra = [stack.add_frontend(), stack.add_frontend()]
        children = [*stack.children, *extra]
        frontends = [c for c in children if c.kind == "frontend"]
        targets = {
            f"{c.name.replace('[', '-').replace(']', '')}-{i}": c.metrics_url
            for i, c in enumerate(children)
        }
        prometheus = PrometheusServer(targets, tmp_path_factory.mktemp("prometheus")).start()
        yield stack, frontends, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_children(extra)
        stack.stop()


def test_sum_of_waiting_over_three_frontends_is_the_cores_truth(
    served: tuple[Stack, list[Child], PrometheusServer],
) -> None:
    stack, frontends, prom = served
    calls: list[grpc.Future] = []
    channels = [grpc.insecure_channel(f.address) for f in frontends]
    try:
        for i in range(NUM_REQUESTS):
            stub = gen_grpc.GenerationServiceStub(channels[i % len(channels)])
            request = text_request(f"wait {i}", max_tokens=1500, ignore_eos=True)
            call = stub.Generate(request, timeout=120)
            threading.Thread(target=drain, args=(call,), daemon=True).start()
            calls.append(call)
        waiting = NUM_REQUESTS - 1
        assert prom.wait_for(f"vllm:num_requests_waiting{SEL}", waiting) == waiting
        assert len(prom.query(f"vllm:num_requests_waiting{SEL}")) == 1  # one source: the core
        by = f"sum by(model_name) (vllm:num_requests_waiting{SEL})"
        assert float(prom.query(by)[0]["value"][1]) == waiting
        by_reason = f'vllm:num_requests_waiting_by_reason{{model_name="{MODEL}",reason="capacity"}}'
        assert prom.value(by_reason) == waiting
        assert prom.value(f"vllm:num_requests_running{SEL}") == 1
        assert stack.scheduler_stats().num_waiting_reqs == waiting
        for frontend in frontends:  # what a gateway scraping the serving port reads
            seen = serving_port_metrics(frontend)
            assert seen["vllm:num_requests_waiting"] == waiting, frontend.name
            assert seen["vllm:num_requests_waiting_by_reason|deferred"] == 0
            for name in ("vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
                         "vllm:iteration_tokens_total_count", "vllm:mm_cache_queries_total",
                         "vllm:kv_cache_usage_perc"):  # fmt: skip
                assert name in seen, name
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    assert prom.wait_for(f"vllm:num_requests_waiting{SEL}", 0) == 0


def test_request_level_series_add_up_over_the_frontends(
    served: tuple[Stack, list[Child], PrometheusServer],
) -> None:
    """Each frontend counts what it served; the standard gRPC server metrics; vLLM's
    prompt_tokens_cached and request_prefill_kv_computed_tokens."""
    _, frontends, prom = served
    prompt = " ".join(["river stone light token engine quiet"] * 6)
    for frontend in frontends:  # the same prompt: the second and third hit the prefix cache
        with grpc.insecure_channel(frontend.address) as channel:
            stub = gen_grpc.GenerationServiceStub(channel)
            for _ in stub.Generate(text_request(prompt, max_tokens=2), timeout=60):
                pass
    ok = (
        'grpc_server_handled_total{grpc_method="Generate",grpc_code="OK",grpc_type="server_stream"}'
    )
    assert prom.wait_for(ok, len(frontends)) == len(frontends)
    assert len(prom.query(ok)) == len(frontends)  # one series per frontend
    timed = 'grpc_server_handling_seconds_count{grpc_method="Generate"}'
    assert prom.value(timed) >= len(frontends)
    cached = prom.settled(f"vllm:prompt_tokens_cached_total{SEL}")
    assert cached >= 2 * 32  # two full blocks at least, on each of the later two
    computed = prom.value(f"vllm:request_prefill_kv_computed_tokens_sum{SEL}")
    prompts = prom.value(f"vllm:prompt_tokens_total{SEL}")  # counted at the first token
    assert computed + cached == prompts
