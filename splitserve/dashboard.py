"""The Grafana dashboard shipped in the Helm chart, generated from this file.

`python -m splitserve.dashboard > helm/splitserve/dashboards/splitserve.json` rewrites it; a test
checks that the committed JSON equals this output. Panels follow vLLM's reference dashboard
(so its users see the same graphs), plus splitserve's own: the cost of each gRPC hop, the worker
step split, and gRPC status codes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = '{model_name="$model_name"}'
RATE = "[$__rate_interval]"
QUANTILES = (0.99, 0.95, 0.9, 0.5)
WIDTH, HEIGHT = 12, 8


def _target(expr: str, legend: str, ref: int, fmt: str = "time_series") -> dict[str, Any]:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend,
        "refId": chr(65 + ref),
        "format": fmt,
        "range": True,
    }


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le, {by}" if by else "le"
    legend_suffix = f" {{{{{by}}}}}" if by else ""
    exprs = [
        (
            f"histogram_quantile({q}, sum by({group}) (rate({metric}_bucket{SEL}{RATE})))",
            f"P{int(q * 100)}{legend_suffix}",
        )
        for q in QUANTILES
    ]
    if not by:
        exprs.append(
            (f"rate({metric}_sum{SEL}{RATE}) / rate({metric}_count{SEL}{RATE})", "Average")
        )
    return exprs


def _panel(
    title: str, description: str, exprs: list[tuple[str, str]], unit: str, kind: str = "timeseries"
) -> dict[str, Any]:
    fmt = "heatmap" if kind == "heatmap" else "time_series"
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [_target(e, legend, i, fmt) for i, (e, legend) in enumerate(exprs)],
    }


def vllm_panels() -> list[dict[str, Any]]:
    """The panels of vLLM's reference dashboard, on the same metric names."""
    return [
        _panel(
            "E2E Request Latency",
            "End-to-end latency, on the frontend's clock.",
            _quantiles("vllm:e2e_request_latency_seconds"),
            "s",
        ),
        _panel(
            "Token Throughput",
            "Prompt and generation tokens per second.",
            [
                (f"rate(vllm:prompt_tokens_total{SEL}{RATE})", "Prompt Tokens/s"),
                (f"rate(vllm:generation_tokens_total{SEL}{RATE})", "Generation Tokens/s"),
            ],
            "none",
        ),
        _panel(
            "Inter Token Latency",
            "Time between engine steps that gave a request tokens.",
            _quantiles("vllm:inter_token_latency_seconds"),
            "s",
        ),
        _panel(
            "Scheduler State",
            "Requests running and waiting in the engine core.",
            [
                (f"vllm:num_requests_running{SEL}", "Num Running"),
                (f"vllm:num_requests_waiting{SEL}", "Num Waiting"),
            ],
            "none",
        ),
        _panel(
            "Time To First Token Latency",
            "Arrival at the frontend to the first token.",
            _quantiles("vllm:time_to_first_token_seconds"),
            "s",
        ),
        _panel(
            "Cache Utilization",
            "Fraction of KV-cache blocks in use.",
            [(f"vllm:kv_cache_usage_perc{SEL}", "KV Cache Usage")],
            "percentunit",
        ),
        _panel(
            "Request Prompt Length",
            "Prompt tokens per finished request.",
            [(f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SEL}{RATE}))", "{{le}}")],
            "none",
            "heatmap",
        ),
        _panel(
            "Request Generation Length",
            "Generated tokens per finished request.",
            [
                (
                    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SEL}{RATE}))",
                    "{{le}}",
                )
            ],
            "none",
            "heatmap",
        ),
        _panel(
            "Finish Reason",
            "Finished requests by reason.",
            [
                (
                    f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}{RATE}))",
                    "{{finished_reason}}",
                )
            ],
            "none",
        ),
        _panel(
            "Queue Time",
            "Seconds requests spent waiting, per second.",
            [(f"rate(vllm:request_queue_time_seconds_sum{SEL}{RATE})", "Queue Time")],
            "s",
        ),
        _panel(
            "Requests Prefill and Decode Time",
            "Seconds in prefill and decode, per second.",
            [
                (f"rate(vllm:request_prefill_time_seconds_sum{SEL}{RATE})", "Prefill"),
                (f"rate(vllm:request_decode_time_seconds_sum{SEL}{RATE})", "Decode"),
            ],
            "s",
        ),
        _panel(
            "Time Per Output Token",
            "Per request: decode time / (tokens - 1).",
            _quantiles("vllm:request_time_per_output_token_seconds"),
            "s",
        ),
        _panel(
            "Prefix Cache Hit Rate",
            "Prompt tokens served from the prefix cache.",
            [
                (
                    f"rate(vllm:prefix_cache_hits_total{SEL}{RATE}) / "
                    f"clamp_min(rate(vllm:prefix_cache_queries_total{SEL}{RATE}), 1)",
                    "Hit Rate",
                )
            ],
            "percentunit",
        ),
        _panel(
            "Preemptions",
            "Requests preempted (KV blocks ran out), per second.",
            [(f"rate(vllm:num_preemptions_total{SEL}{RATE})", "Preemptions/s")],
            "none",
        ),
        _panel(
            "Tokens per Engine Step",
            "Prompt + generation tokens scheduled per step.",
            _quantiles("vllm:iteration_tokens_total")[:3],
            "none",
        ),
        _panel(
            "Request Parameters",
            "n and max_tokens of incoming requests.",
            [
                (
                    f"rate(vllm:request_params_n_sum{SEL}{RATE}) / "
                    f"rate(vllm:request_params_n_count{SEL}{RATE})",
                    "mean n",
                ),
                (
                    f"rate(vllm:request_params_max_tokens_sum{SEL}{RATE}) / "
                    f"rate(vllm:request_params_max_tokens_count{SEL}{RATE})",
                    "mean max_tokens",
                ),
            ],
            "none",
        ),
    ]


def splitserve_panels() -> list[dict[str, Any]]:
    """What only a split design shows: each hop, each worker, each RPC."""
    return [
        _panel(
            "Frontend <-> Core Round Trip",
            "Ping RTT over the EngineStream (frontend clock).",
            _quantiles("splitserve_frontend_core_rtt_seconds"),
            "s",
        ),
        _panel(
            "Core <-> Worker Hop per Step",
            "Step round trip minus the worker's own step time (core clock).",
            _quantiles("splitserve_core_worker_hop_seconds"),
            "s",
        ),
        _panel(
            "Core <-> Worker Step Round Trip",
            "SchedulerOutput out to ModelRunnerOutput back.",
            _quantiles("splitserve_core_worker_rtt_seconds"),
            "s",
        ),
        _panel(
            "Per-Message Hop Latency",
            "Core: outputs handed to a stream until written; frontend: processing per message.",
            [
                (
                    f"histogram_quantile(0.99, sum by(le) (rate("
                    f"splitserve_core_output_send_seconds_bucket{SEL}{RATE})))",
                    "core send P99",
                ),
                (
                    f"histogram_quantile(0.99, sum by(le) (rate("
                    f"splitserve_frontend_output_processing_seconds_bucket{SEL}{RATE})))",
                    "frontend processing P99",
                ),
            ],
            "s",
        ),
        _panel(
            "Worker Step Time by Phase",
            "P90 of prepare inputs / forward / sample per rank.",
            [
                (
                    f"histogram_quantile(0.9, sum by(le, phase, rank) (rate("
                    f"splitserve_worker_step_seconds_bucket{SEL}{RATE})))",
                    "{{phase}} rank {{rank}}",
                )
            ],
            "s",
        ),
        _panel(
            "Worker KV Blocks in Use",
            "Blocks referenced by live requests, per rank.",
            [(f"splitserve_worker_kv_blocks_used{SEL}", "rank {{rank}}")],
            "none",
        ),
        _panel(
            "gRPC Requests by Method and Code",
            "RPCs completed per second, all services.",
            [
                (
                    f"sum by(grpc_method, grpc_code) (rate(splitserve_grpc_server_handled_total{RATE}))",
                    "{{grpc_method}} {{grpc_code}}",
                )
            ],
            "reqps",
        ),
        _panel(
            "Stream Reconnects and Open Streams",
            "Frontend reconnects to the core; frontends connected to the core.",
            [
                (f"increase(splitserve_frontend_core_reconnects_total{SEL}{RATE})", "reconnects"),
                (f"splitserve_core_frontend_streams{SEL}", "open streams"),
            ],
            "none",
        ),
    ]


def _layout(panels: list[dict[str, Any]], first_id: int, top: int) -> int:
    for i, panel in enumerate(panels):
        panel["id"] = first_id + i
        panel["gridPos"] = {
            "h": HEIGHT,
            "w": WIDTH,
            "x": (i % 2) * WIDTH,
            "y": top + (i // 2) * HEIGHT,
        }
    return top + ((len(panels) + 1) // 2) * HEIGHT


def _row(title: str, panel_id: int, top: int) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "id": panel_id,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": top},
    }


def templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": "DS_PROMETHEUS",
                "label": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
            },
            {
                "name": "model_name",
                "label": "model_name",
                "type": "query",
                "datasource": DS,
                "definition": "label_values(vllm:num_requests_running, model_name)",
                "query": {
                    "query": "label_values(vllm:num_requests_running, model_name)",
                    "refId": "model_name",
                },
                "current": {},
                "hide": 0,
                "refresh": 2,
                "includeAll": False,
                "multi": False,
            },
        ]
    }


def build() -> dict[str, Any]:
    vllm, split = vllm_panels(), splitserve_panels()
    top = _layout(vllm, 2, 1)
    _layout(split, 2 + len(vllm) + 1, top + 1)
    rows = [
        _row("vLLM", 1, 0),
        *vllm,
        _row("splitserve: hops and workers", 2 + len(vllm), top),
        *split,
    ]
    return {
        "title": "splitserve",
        "uid": "splitserve",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "tags": ["splitserve", "vllm"],
        "timezone": "browser",
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": templating(),
        "panels": rows,
        "annotations": {"list": []},
    }


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression in a dashboard."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def main() -> int:
    json.dump(build(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
