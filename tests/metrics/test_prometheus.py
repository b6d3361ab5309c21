"""A real Prometheus scrapes all three services of a running stack while requests run.

Checks every vLLM-compatible metric and every splitserve metric against what the clients saw,
then resolves the shipped Grafana dashboard's variables as Grafana would and runs every panel's
PromQL against that Prometheus (after a gRPC error and HTTP requests, one of them refused).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve import dashboard
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import Completion, generate, text_request
from tests.e2e.stack import Stack
from tests.metrics.dashboard_queries import (
    grafana_value,
    parse_label_values,
    substitute,
)
from tests.metrics.prometheus_server import PrometheusServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus is not installed (.ci/run installs it)",
    ),
]
DASHBOARD = dashboard.JSON_PATH
RATE_INTERVAL = "5m"  # $__rate_interval: a window that holds this module's requests
MODEL = "metrics-model"
SEL = f'{{model_name="{MODEL}"}}'
LONG_PROMPT = " ".join(["river stone light token engine quiet"] * 12)


class Seen:
    """What the clients saw."""

    def __init__(self) -> None:
        self.tokens = 0
        self.prompt_tokens = 0
        self.reasons: dict[str, int] = {}
        self.longest_sum = 0  # per request: tokens of its longest completion, summed

    def add(self, result: dict[int, Completion]) -> None:
        self.longest_sum += max(len(c.token_ids) for c in result.values())
        for completion in result.values():
            self.tokens += len(completion.token_ids)
            self.prompt_tokens += completion.usage.prompt_tokens
            reason = {1: "stop", 2: "length", 3: "abort", 4: "error"}[completion.finish_reason]
            self.reasons[reason] = self.reasons.get(reason, 0) + 1


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, PrometheusServer]]:
    stack = Stack(tiny_model_dir, core_flags=["--served-model-name", MODEL], supervise=True).start()
    targets = {c.name.replace("[", "-").replace("]", ""): c.metrics_url for c in stack.children}
    prometheus = PrometheusServer(targets, tmp_path_factory.mktemp("prometheus")).start()
    try:
        yield stack, prometheus
    finally:
        prometheus.stop()
        stack.stop()


@pytest.fixture(scope="module")
def seen(served: tuple[Stack, PrometheusServer]) -> Seen:
    stack, _ = served
    seen = Seen()
    for max_tokens in (10, 20, 30, 40):
        seen.add(
            generate(
                stack.frontend,
                text_request(
                    "The quick brown fox", temperature=0.0, max_tokens=max_tokens, ignore_eos=True
                ),
            )
        )
    for _ in range(2):  # the second one hits the prefix cache
        seen.add(generate(stack.frontend, text_request(LONG_PROMPT, max_tokens=5, ignore_eos=True)))
    base = generate(
        stack.frontend,
        text_request("The quick brown fox", temperature=0.0, max_tokens=10, ignore_eos=True),
    )
    seen.add(base)
    ids = base[0].token_ids
    stop_id = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    seen.add(
        generate(
            stack.frontend,
            text_request(
                "The quick brown fox", temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]
            ),
        )
    )
    seen.add(
        generate(
            stack.frontend,
            text_request(
                "Two samples", n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True
            ),
        )
    )
    return seen


def test_targets_are_up(served: tuple[Stack, PrometheusServer], seen: Seen) -> None:
    _, prometheus = served
    assert set(prometheus.targets_up().values()) == {"up"}


def test_counters_match_what_clients_saw(
    served: tuple[Stack, PrometheusServer], seen: Seen
) -> None:
    _, prom = served
    assert prom.wait_for(f"vllm:generation_tokens_total{SEL}", seen.tokens) == seen.tokens
    assert prom.wait_for(f"vllm:prompt_tokens_total{SEL}", seen.prompt_tokens) == (
        seen.prompt_tokens
    )
    for reason, count in seen.reasons.items():
        expr = f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="{reason}"}}'
        assert prom.wait_for(expr, count) == count, reason
    finished = sum(seen.reasons.values())
    for histogram in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert prom.wait_for(f"vllm:{histogram}_count{SEL}", finished) == finished, histogram
    assert prom.value(f"vllm:request_generation_tokens_sum{SEL}") == seen.tokens
    assert prom.value(f"vllm:inter_token_latency_seconds_count{SEL}") == seen.tokens - finished
    assert prom.value(f"vllm:request_params_n_count{SEL}") == 9
    assert prom.value(f"vllm:request_params_n_sum{SEL}") == 10
    assert prom.value(f"vllm:request_max_num_generation_tokens_count{SEL}") == 9
    assert prom.value(f"vllm:request_max_num_generation_tokens_sum{SEL}") == seen.longest_sum


def test_scheduler_metrics_are_sane(served: tuple[Stack, PrometheusServer], seen: Seen) -> None:
    _, prom = served
    assert prom.wait_for(f"vllm:num_requests_running{SEL}", 0) == 0
    assert prom.value(f"vllm:num_requests_waiting{SEL}") == 0
    assert prom.wait_for(f"vllm:kv_cache_usage_perc{SEL}", 0) == 0
    # settled: the gauges above may already read 0 in a scrape from before the requests
    assert prom.settled(f"vllm:prefix_cache_queries_total{SEL}") >= seen.prompt_tokens
    assert 16 <= prom.value(f"vllm:prefix_cache_hits_total{SEL}") < seen.prompt_tokens
    assert prom.value(f"vllm:num_preemptions_total{SEL}") == 0
    steps = prom.value(f"vllm:iteration_tokens_total_count{SEL}")
    scheduled = prom.value(f"vllm:iteration_tokens_total_sum{SEL}")
    assert steps >= max(40, seen.tokens // 9)
    assert scheduled >= seen.tokens
    info = prom.query("vllm:cache_config_info")
    assert info and info[0]["metric"]["block_size"] == "16"


def test_splitserve_hop_and_worker_metrics(
    served: tuple[Stack, PrometheusServer], seen: Seen
) -> None:
    _, prom = served
    steps = prom.settled(f"splitserve_core_worker_rtt_seconds_count{SEL}")
    assert steps >= prom.value(f"vllm:iteration_tokens_total_count{SEL}") > 0
    assert prom.value(f"splitserve_core_worker_hop_seconds_count{SEL}") == steps
    assert prom.value(f"splitserve_core_step_seconds_count{SEL}") == steps
    assert (
        0
        < prom.value(f"splitserve_core_worker_hop_seconds_sum{SEL}")
        < prom.value(f"splitserve_core_worker_rtt_seconds_sum{SEL}")
    )
    assert prom.value(f"splitserve_core_output_send_seconds_count{SEL}") > 0
    assert prom.value(f"splitserve_frontend_output_processing_seconds_count{SEL}") > 0
    assert prom.wait_for(f"clamp_max(splitserve_frontend_core_rtt_seconds_count{SEL}, 1)", 1) == 1
    for phase in ("prepare_inputs", "forward", "sample", "total"):
        expr = f'splitserve_worker_step_seconds_count{{model_name="{MODEL}",phase="{phase}"}}'
        assert prom.wait_for(expr, steps) == steps, phase  # another target: scrapes differ
    assert prom.wait_for(f"splitserve_worker_kv_blocks_used{SEL}", 0) == 0
    generate_ok = 'grpc_server_handled_total{grpc_method="Generate",grpc_code="OK"}'
    assert prom.wait_for(generate_ok, 9) == 9
    assert prom.value(f"splitserve_core_frontend_streams{SEL}") == 1
    assert prom.value(f"splitserve_frontend_core_reconnects_total{SEL}") == 0


def test_an_aborted_request_is_counted_and_frees_blocks(
    served: tuple[Stack, PrometheusServer], seen: Seen
) -> None:
    stack, prom = served
    with grpc.insecure_channel(stack.frontend) as channel:
        call = gen_grpc.GenerationServiceStub(channel).Generate(
            text_request("cancel me", max_tokens=1500, ignore_eos=True), timeout=60
        )
        next(call)
        call.cancel()
    expr = f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="abort"}}'
    assert prom.wait_for(expr, 1) == 1
    assert prom.wait_for(f"vllm:kv_cache_usage_perc{SEL}", 0) == 0
    cancelled = 'grpc_server_handled_total{grpc_method="Generate",grpc_code="CANCELLED"}'
    assert prom.wait_for(cancelled, 1) == 1


def recover_from_a_killed_rank(stack: Stack, prom: PrometheusServer) -> None:
    """What the recovery row needs: the worker rank killed (and restarted by the stack's
    supervisor, as `splitserve up` restarts it); the next request waits for the core to bring it
    up again and finishes."""
    rank = stack.child("worker[0]")
    old = rank.process
    old.send_signal(signal.SIGKILL)  # a rank this test started, by PID
    old.wait(30)
    result = generate(stack.frontend, text_request("after the restart", max_tokens=4))
    assert len(result[0].token_ids) == 4 and rank.process is not old
    recovered = f"splitserve_engine_recovery_seconds_count{SEL}"
    assert prom.wait_for(f"clamp_max(count_over_time({recovered}[{RATE_INTERVAL}]), 2)", 2) == 2
    assert prom.wait_for(recovered, 1) == 1


def _post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def dashboard_traffic(served: tuple[Stack, PrometheusServer], seen: Seen) -> None:
    """What the error, HTTP and recovery panels need: a refused gRPC call, an HTTP answer and
    a refusal, a worker rank restarted."""
    stack, prom = served
    recover_from_a_killed_rank(stack, prom)
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack.frontend, text_request("too cold", temperature=-1.0, max_tokens=4))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    completions = f"{stack.http}/v1/completions"
    assert _post(completions, {"model": MODEL, "prompt": "Hello", "max_tokens": 4}) == 200
    assert _post(completions, {"model": "no-such-model", "prompt": "Hello"}) == 404
    invalid = 'grpc_server_handled_total{grpc_method="Generate",grpc_code="INVALID_ARGUMENT"}'
    http = 'http_requests_total{{handler="/v1/completions",status="{}"}}'
    for counted in (invalid, http.format("2xx"), http.format("4xx")):
        assert prom.wait_for(counted, 1) == 1
        # rate() needs two samples of a series: the first scrape of a new one is not enough.
        assert prom.wait_for(f"clamp_max(count_over_time({counted}[{RATE_INTERVAL}]), 2)", 2) == 2


@pytest.fixture(scope="module")
def variables(
    served: tuple[Stack, PrometheusServer], dashboard_traffic: None
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each query variable's values, resolved in order as Grafana does (label_values()), and
    what Grafana puts in the queries when all of them are selected."""
    _, prom = served
    found: dict[str, list[str]] = {}
    values: dict[str, str] = {}
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = substitute(variable["query"], values, RATE_INTERVAL)
        selector, label = parse_label_values(query)
        found[variable["name"]] = prom.label_values(label, selector)
        values[variable["name"]] = grafana_value(found[variable["name"]], variable["multi"])
    return found, values


def test_dashboard_variables_resolve_to_the_stacks_labels(
    served: tuple[Stack, PrometheusServer], variables: tuple[dict[str, list[str]], dict[str, str]]
) -> None:
    _, prom = served
    found, values = variables
    assert found == {"model_name": [MODEL], "engine": ["0"], "pod": sorted(prom.targets)}
    assert values["pod"] == f"({'|'.join(sorted(prom.targets))})"


def test_every_dashboard_panel_finds_data(
    served: tuple[Stack, PrometheusServer], variables: tuple[dict[str, list[str]], dict[str, str]]
) -> None:
    """Every expression of every panel, with the variables set to the stack's real values (all
    pods selected), returns series, and every panel has a number to draw."""
    _, prom = served
    _, values = variables
    board = json.loads(DASHBOARD.read_text())
    empty, blank = [], []
    for panel in dashboard.panels(board):
        numbers: list[float] = []
        for target in panel["targets"]:
            result = prom.query(substitute(target["expr"], values, RATE_INTERVAL))
            numbers += [float(r["value"][1]) for r in result]
            if not result:
                empty.append(f"{panel['title']}: {target['expr']}")
        if not any(math.isfinite(n) for n in numbers):
            blank.append(panel["title"])
    assert not empty, "\n".join(empty)
    assert not blank, f"panels with nothing but NaN: {blank}"


REQUIRED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:iteration_tokens_total_count",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:cache_config_info",
    "splitserve_frontend_core_rtt_seconds_count",
    "splitserve_core_worker_rtt_seconds_count",
    "splitserve_core_worker_hop_seconds_count",
    "splitserve_core_output_send_seconds_count",
    "splitserve_frontend_output_processing_seconds_count",
    "splitserve_worker_step_seconds_count",
    "splitserve_worker_kv_blocks_used",
    "grpc_server_handled_total",
    "splitserve_frontend_core_reconnects_total",
    "splitserve_engine_recoveries_total",
    "splitserve_engine_recovery_seconds_count",
    "splitserve_engine_requests_resumed_total",
    "splitserve_frontend_requests_resubmitted_total",
    "vllm:request_max_num_generation_tokens_count",
    "vllm:num_requests_waiting_by_reason",
    "vllm:prompt_tokens_cached_total",
    "vllm:request_prefill_kv_computed_tokens_count",
    "vllm:mm_cache_queries_total",
    "vllm:mm_cache_hits_total",
    "grpc_server_started_total",
    "grpc_server_handling_seconds_count",
    "grpc_client_started_total",
    "grpc_client_handled_total",
    "grpc_client_handling_seconds_count",
    "http_requests_total",
]


def test_every_required_metric_is_scraped(
    served: tuple[Stack, PrometheusServer], seen: Seen, dashboard_traffic: None
) -> None:
    """Every metric the metrics issue names is in Prometheus; the values go to
    $SPLITSERVE_METRICS_REPORT (JSON) when set, for the record."""
    import os

    _, prom = served
    values = {name: prom.value(name) for name in REQUIRED}
    missing = [name for name, value in values.items() if math.isnan(value)]
    assert not missing
    report = os.environ.get("SPLITSERVE_METRICS_REPORT")
    if report:
        Path(report).write_text(json.dumps(values, indent=1) + "\n")
