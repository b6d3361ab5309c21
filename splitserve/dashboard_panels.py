"""What the shipped Grafana dashboard shows, as data: rows of panels, each with its PromQL.

splitserve/dashboard.py turns these into Grafana JSON with grafana-foundation-sdk. The first row
is vLLM's reference dashboard on vLLM's metric names (so its users see the same graphs); then
errors by status code, what only a split design shows (each hop, each worker) and recovery.

Every query filters on the dashboard's variables: `$model_name`, `$engine` (vLLM's labels) and
`$pod` (the label Prometheus Operator's ServiceMonitor gives every series). Series without
vLLM's labels (gRPC and HTTP request counters, per process) are kept to the processes serving
the chosen model and engines by joining on `instance` with any series of those processes that
has them (`FOR_SELECTED_PROCESSES`). Every engine series (running, waiting, KV usage, prefix
cache, preemptions) has one source in Prometheus, the engine core (the frontends show them only
on their serving port, which the ServiceMonitor does not scrape): they sum by engine, as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_AND_ENGINES = 'model_name="$model_name", engine=~"$engine"'
POD = 'pod=~"$pod"'
SELECTED = "{" + MODEL_AND_ENGINES + ", " + POD + "}"
"""Series with vLLM's labels, of the chosen model, engines and pods."""
RATE = "[$__rate_interval]"
QUANTILES = (0.99, 0.95, 0.9, 0.5)
FOR_SELECTED_PROCESSES = (
    f" * on(instance) group_left() group by(instance) ({{{MODEL_AND_ENGINES}}})"
)
"""Appended to a per-process expression: keeps the processes that serve the chosen model and
engines (a join on `instance` with any of their series that has vLLM's labels)."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str
    kind: str = "timeseries"  # or "heatmap"
    width: int = 12


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


def quantiles(metric: str, qs: tuple[float, ...] = QUANTILES) -> tuple[Query, ...]:
    """P99/P95/P90/P50 of a histogram over the selection, plus its mean (vLLM's panels)."""
    rate = f"rate({metric}_bucket{SELECTED}{RATE})"
    found = tuple(
        Query(f"histogram_quantile({q}, sum by(le) ({rate}))", f"P{round(q * 100)}") for q in qs
    )
    mean = f"sum(rate({metric}_sum{SELECTED}{RATE})) / sum(rate({metric}_count{SELECTED}{RATE}))"
    return (*found, Query(mean, "Average"))


def total_rate(metric: str, legend: str, by: str = "") -> Query:
    grouping = f" by({by}) " if by else ""
    return Query(f"sum{grouping}(rate({metric}{SELECTED}{RATE}))", legend)


def engine_gauge(metric: str, legend: str) -> Query:
    return Query(f"sum by(engine) ({metric}{SELECTED})", f"{legend} (engine {{{{engine}}}})")


def per_process(expr: str) -> str:
    """A per-process rate (no vLLM labels), kept to the chosen model, engines and pods."""
    return f"{expr}{FOR_SELECTED_PROCESSES}"


def _rate_by_engine(metric: str) -> str:
    return f"sum by(engine) (rate({metric}{SELECTED}{RATE}))"


def _p99(metric: str) -> str:
    return f"histogram_quantile(0.99, sum by(le) (rate({metric}_bucket{SELECTED}{RATE})))"


def length_heatmap(title: str, description: str, metric: str) -> PanelSpec:
    expr = f"sum by(le) (increase({metric}_bucket{SELECTED}{RATE}))"
    return PanelSpec(title, description, (Query(expr, "{{le}}"),), "none", "heatmap")


VLLM_ROW = RowSpec(
    "vLLM",
    (
        PanelSpec(
            "E2E Request Latency",
            "End-to-end latency, on the frontend's clock.",
            quantiles("vllm:e2e_request_latency_seconds"),
            "s",
        ),
        PanelSpec(
            "Token Throughput",
            "Prompt and generation tokens per second.",
            (
                total_rate("vllm:prompt_tokens_total", "Prompt Tokens/s"),
                total_rate("vllm:generation_tokens_total", "Generation Tokens/s"),
            ),
            "none",
        ),
        PanelSpec(
            "Inter Token Latency",
            "Time between engine steps that gave a request tokens.",
            quantiles("vllm:inter_token_latency_seconds"),
            "s",
        ),
        PanelSpec(
            "Scheduler State",
            "Requests running and waiting in each engine core.",
            (
                engine_gauge("vllm:num_requests_running", "Num Running"),
                engine_gauge("vllm:num_requests_waiting", "Num Waiting"),
            ),
            "none",
        ),
        PanelSpec(
            "Time To First Token Latency",
            "Arrival at the frontend to the first token.",
            quantiles("vllm:time_to_first_token_seconds"),
            "s",
        ),
        PanelSpec(
            "Cache Utilization",
            "Fraction of KV-cache blocks in use, per engine.",
            (engine_gauge("vllm:kv_cache_usage_perc", "KV Cache Usage"),),
            "percentunit",
        ),
        length_heatmap(
            "Request Prompt Length",
            "Prompt tokens per finished request.",
            "vllm:request_prompt_tokens",
        ),
        length_heatmap(
            "Request Generation Length",
            "Generated tokens per finished request.",
            "vllm:request_generation_tokens",
        ),
        PanelSpec(
            "Finish Reason",
            "Finished requests by reason (stop, length, abort, error).",
            (
                Query(
                    f"sum by(finished_reason) "
                    f"(increase(vllm:request_success_total{SELECTED}{RATE}))",
                    "{{finished_reason}}",
                ),
            ),
            "none",
        ),
        PanelSpec(
            "Queue Time",
            "Seconds requests spent waiting, per second.",
            (total_rate("vllm:request_queue_time_seconds_sum", "Queue Time"),),
            "s",
        ),
        PanelSpec(
            "Requests Prefill and Decode Time",
            "Seconds in prefill and decode, per second.",
            (
                total_rate("vllm:request_prefill_time_seconds_sum", "Prefill"),
                total_rate("vllm:request_decode_time_seconds_sum", "Decode"),
            ),
            "s",
        ),
        PanelSpec(
            "Max Generation Token in Sequence Group",
            "Longest of a request's n completions, in tokens (summed per second).",
            (total_rate("vllm:request_max_num_generation_tokens_sum", "Max Tokens"),),
            "none",
        ),
        PanelSpec(
            "Time Per Output Token",
            "Per request: decode time / (tokens - 1).",
            quantiles("vllm:request_time_per_output_token_seconds"),
            "s",
        ),
        PanelSpec(
            "Prefix Cache Hit Rate",
            "Prompt tokens served from the prefix cache, per engine.",
            (
                Query(
                    _rate_by_engine("vllm:prefix_cache_hits_total")
                    + " / "
                    + _rate_by_engine("vllm:prefix_cache_queries_total"),
                    "Hit Rate (engine {{engine}})",
                ),
            ),
            "percentunit",
        ),
        PanelSpec(
            "Preemptions",
            "Requests preempted (KV blocks ran out), per second and engine.",
            (total_rate("vllm:num_preemptions_total", "engine {{engine}}", by="engine"),),
            "none",
        ),
        PanelSpec(
            "Tokens per Engine Step",
            "Prompt + generation tokens scheduled per step.",
            quantiles("vllm:iteration_tokens_total", (0.99, 0.9, 0.5)),
            "none",
        ),
        PanelSpec(
            "Request Parameters",
            "Mean n and max_tokens of incoming requests.",
            (
                Query(
                    f"sum(rate(vllm:request_params_n_sum{SELECTED}{RATE})) / "
                    f"sum(rate(vllm:request_params_n_count{SELECTED}{RATE}))",
                    "mean n",
                ),
                Query(
                    f"sum(rate(vllm:request_params_max_tokens_sum{SELECTED}{RATE})) / "
                    f"sum(rate(vllm:request_params_max_tokens_count{SELECTED}{RATE}))",
                    "mean max_tokens",
                ),
            ),
            "none",
        ),
    ),
)


_GRPC = f"rate(grpc_server_handled_total{{{POD}}}{RATE})"
_HTTP = f"rate(http_requests_total{{{POD}}}{RATE})"
_GRPC_ERRORS = f'rate(grpc_server_handled_total{{grpc_code!="OK", {POD}}}{RATE})'
_GRPC_TIMES = f'rate(grpc_server_handling_seconds_bucket{{grpc_type!="bidi_stream", {POD}}}{RATE})'
_HTTP_ERRORS = f'rate(http_requests_total{{status=~"[45]..", {POD}}}{RATE})'
ERRORS_ROW = RowSpec(
    "Errors and requests by status code",
    (
        PanelSpec(
            "Errors by Code",
            "gRPC calls that did not end OK (all services; CANCELLED: the client left) and "
            "HTTP responses 4xx/5xx, per second.",
            (
                Query(f"sum by(grpc_code) ({per_process(_GRPC_ERRORS)})", "gRPC {{grpc_code}}"),
                Query(f"sum by(status) ({per_process(_HTTP_ERRORS)})", "HTTP {{status}}"),
            ),
            "reqps",
            width=24,
        ),
        PanelSpec(
            "gRPC Requests by Method and Code",
            "RPCs completed per second, all services.",
            (
                Query(
                    f"sum by(grpc_method, grpc_code) ({per_process(_GRPC)})",
                    "{{grpc_method}} {{grpc_code}}",
                ),
            ),
            "reqps",
        ),
        PanelSpec(
            "gRPC Handling Time by Method (P99)",
            "Start to end of each call (Generate: the whole stream), all services; the long-lived "
            "bidirectional streams (EngineStream, Execute) left out.",
            (
                Query(
                    "histogram_quantile(0.99, sum by(le, grpc_method) "
                    f"({per_process(_GRPC_TIMES)}))",
                    "{{grpc_method}}",
                ),
            ),
            "s",
        ),
        PanelSpec(
            "HTTP Requests by Handler and Status",
            "OpenAI API requests per second (health probes and scrapes left out).",
            (Query(f"sum by(handler, status) ({per_process(_HTTP)})", "{{handler}} {{status}}"),),
            "reqps",
        ),
    ),
)


_PHASES = (
    "histogram_quantile(0.9, sum by(le, phase, rank) "
    f"(rate(splitserve_worker_step_seconds_bucket{SELECTED}{RATE})))"
)
HOPS_ROW = RowSpec(
    "splitserve: hops and workers",
    (
        PanelSpec(
            "Frontend <-> Core Round Trip",
            "Ping RTT over the EngineStream (frontend clock).",
            quantiles("splitserve_frontend_core_rtt_seconds"),
            "s",
        ),
        PanelSpec(
            "Core <-> Worker Hop per Step",
            "Step round trip minus the worker's own step time (core clock).",
            quantiles("splitserve_core_worker_hop_seconds"),
            "s",
        ),
        PanelSpec(
            "Core <-> Worker Step Round Trip",
            "SchedulerOutput out to ModelRunnerOutput back.",
            quantiles("splitserve_core_worker_rtt_seconds"),
            "s",
        ),
        PanelSpec(
            "Per-Message Hop Latency",
            "Core: outputs handed to a stream until written; frontend: processing per message.",
            (
                Query(_p99("splitserve_core_output_send_seconds"), "core send P99"),
                Query(
                    _p99("splitserve_frontend_output_processing_seconds"),
                    "frontend processing P99",
                ),
            ),
            "s",
        ),
        PanelSpec(
            "Worker Step Time by Phase",
            "P90 of prepare inputs / forward / sample / total per rank.",
            (Query(_PHASES, "{{phase}} rank {{rank}}"),),
            "s",
        ),
        PanelSpec(
            "Worker KV Blocks in Use",
            "Blocks referenced by live requests, per rank.",
            (
                Query(
                    f"max by(engine, rank) (splitserve_worker_kv_blocks_used{SELECTED})",
                    "engine {{engine}} rank {{rank}}",
                ),
            ),
            "none",
        ),
    ),
)


RECOVERY_ROW = RowSpec(
    "Recovery",
    (
        PanelSpec(
            "Engine Recoveries by Cause",
            "Times an engine core paused stepping to bring its ranks back.",
            (
                Query(
                    f"sum by(cause) (increase(splitserve_engine_recoveries_total{SELECTED}{RATE}))",
                    "{{cause}}",
                ),
            ),
            "none",
        ),
        PanelSpec(
            "Recovery Duration",
            "Pause from the fault to serving again (core clock).",
            quantiles("splitserve_engine_recovery_seconds", (0.99, 0.5)),
            "s",
        ),
        PanelSpec(
            "Requests Resumed and Resubmitted",
            "Core: running requests rescheduled by recompute after a recovery; frontends: "
            "requests sent again to a core that came back.",
            (
                Query(
                    f"sum(increase(splitserve_engine_requests_resumed_total{SELECTED}{RATE}))",
                    "resumed by the core",
                ),
                Query(
                    "sum(increase("
                    f"splitserve_frontend_requests_resubmitted_total{SELECTED}{RATE}))",
                    "resubmitted by frontends",
                ),
            ),
            "none",
        ),
        PanelSpec(
            "Frontend <-> Core Streams",
            "Frontend reconnects to its core; EngineStreams open on each core.",
            (
                Query(
                    f"sum(increase(splitserve_frontend_core_reconnects_total{SELECTED}{RATE}))",
                    "reconnects",
                ),
                engine_gauge("splitserve_core_frontend_streams", "open streams"),
            ),
            "none",
        ),
    ),
)


ROWS = (VLLM_ROW, ERRORS_ROW, HOPS_ROW, RECOVERY_ROW)
