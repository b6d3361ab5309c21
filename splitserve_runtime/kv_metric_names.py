"""The KV connector's counters, one row each, as the core's metrics port and each frontend's
serving port export them (core_svc/kv_connector/metrics.py, frontend_svc/engine/engine_stats.py).

vLLM's `vllm:external_prefix_cache_queries/hits` and splitserve's transfer counters (vLLM's
connectors keep theirs per connector, e.g. NixlConnector's `vllm:nixl_bytes_transferred`; one
set serves every connector here).
"""

from __future__ import annotations

KV_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
        "external_prefix_cache_queries",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
        "external_prefix_cache_hits",
    ),
    (
        "splitserve:kv_transfer_received_bytes",
        "Bytes of KV cache this engine's ranks loaded from a peer engine.",
        "kv_transfer_received_bytes",
    ),
    (
        "splitserve:kv_transfer_seconds",
        "Seconds this engine's ranks spent loading KV cache from peer engines, summed over loads.",
        "kv_transfer_seconds",
    ),
    (
        "splitserve:kv_transfer_loads",
        "KV-cache loads from a peer engine that finished.",
        "kv_transfer_num_loads",
    ),
    (
        "splitserve:kv_transfer_failed_loads",
        "KV-cache loads from a peer engine that failed (the prompt was computed instead).",
        "kv_transfer_num_failed_loads",
    ),
)
"""(metric name, help, SchedulerStats field) per counter; the frontend reads the same rows."""
