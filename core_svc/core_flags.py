"""The flags of `splitserve core` (vLLM's names where vLLM has the flag) and their value parsers.

A flag that sets an engine option names the field it fills (`fills="cache.block_size"`,
common.v1.EngineOptions); without a `help` of its own it says what the contract says of the
field. core_svc/config.py gathers those values into the options record the ranks receive."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from core_svc.lora import lora_module
from core_svc.sched.scheduler_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    DEFAULT_MAX_NUM_SEQS,
)
from splitserve_contracts.engine_options_types import (
    CHOICES,
    CacheOptions,
    KVTransferOptions,
    SchedulerOptions,
)
from splitserve_contracts.spec_decode import (
    InvalidSpeculativeConfig,
    SpeculativeConfig,
    parse_speculative_config,
)
from splitserve_runtime.flags import (
    Flag,
    address_list,
    filling,
    flag,
    non_negative_int,
    positive_int,
)
from splitserve_runtime.kv_connector_names import (
    InvalidKVTransferConfig,
    parse_kv_transfer_config,
)
from splitserve_runtime.log_config import LOGGING_FLAGS
from splitserve_runtime.model_spec import DTYPE_CHOICES, model_flags
from splitserve_runtime.profiler_config import PROFILER_FLAGS
from splitserve_runtime.quantization_names import kv_cache_dtype_flag, quantization_flags
from splitserve_runtime.services import CORE
from splitserve_runtime.tracing import TRACING_FLAGS
from splitserve_runtime.transport_flags import LOOPBACK, internal_tls_flags, listener_flags
from splitserve_runtime.vllm_compat import NO_EFFECT_FLAGS

DEFAULT_PORT = CORE.default_port
DEFAULT_METRICS_PORT = CORE.default_metrics_port


STRUCTURED_OUTPUTS_BACKENDS = CHOICES["structured_outputs.backend"]


def structured_outputs_config(text: str) -> dict[str, Any]:
    """--structured-outputs-config: a JSON object with `backend` and `compile_timeout`."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict) or set(value) - {"backend", "compile_timeout"}:
        raise argparse.ArgumentTypeError('expected {"backend": ..., "compile_timeout": ...}')
    backend = value.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend {backend!r} is not available; the engine core runs llguidance "
            '("guidance" or "auto"): xgrammar would load torch into the core'
        )
    timeout = value.get("compile_timeout", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise argparse.ArgumentTypeError("compile_timeout must be a number of seconds")
    return {"backend": backend, "compile_timeout": float(timeout)}


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's choices of --max-lora-rank."""

LORA_FLAGS: tuple[Flag, ...] = (
    flag(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: requests name one as their model (vLLM's flag)",
    ),
    flag(
        "--lora-modules",
        type=lora_module,
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to load at start-up, as NAME=PATH or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}: a PEFT folder on the workers '
        "(adapter_config.json, adapter_model.safetensors); needs --enable-lora",
    ),
    flag(
        "--max-loras",
        fills="lora.max_loras",
        type=positive_int,
        default=1,
        help="most distinct LoRA adapters in one step (the workers' adapter slots)",
    ),
    flag(
        "--max-lora-rank",
        fills="lora.max_lora_rank",
        type=int,
        default=16,
        choices=MAX_LORA_RANKS,
        help="largest rank an adapter may have (the slots' size)",
    ),
    flag(
        "--max-cpu-loras",
        fills="lora.max_cpu_loras",
        type=positive_int,
        default=None,
        help="adapters each worker keeps in host memory beside its slots, least recently used "
        "dropped first (default: --max-loras)",
    ),
)


def speculative_config(text: str) -> SpeculativeConfig | None:
    """--speculative-config: vLLM's JSON object (splitserve_contracts/spec_decode.py)."""
    try:
        return parse_speculative_config(text)
    except InvalidSpeculativeConfig as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def kv_transfer_config(text: str) -> KVTransferOptions | None:
    """--kv-transfer-config: vLLM's JSON object (splitserve_runtime/kv_connector_names.py)."""
    try:
        return parse_kv_transfer_config(text)
    except InvalidKVTransferConfig as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_SCHEDULER, _CACHE = SchedulerOptions(), CacheOptions()
"""The contract's defaults of the flags that fill those groups."""


def _filling(rows: Sequence[Flag], fields: dict[str, str]) -> tuple[Flag, ...]:
    """Rows declared elsewhere (shared with other services), some filling an engine option."""
    return tuple(filling(r, fields[r.names[0]]) if r.names[0] in fields else r for r in rows)


CORE_FLAGS: tuple[Flag, ...] = (
    *_filling(
        model_flags(is_frontend=False), {"--model": "model.model", "--revision": "model.revision"}
    ),
    flag(
        "--worker-addrs",
        type=address_list,
        default=[],
        help="worker ranks as HOST:PORT,... in rank order (rank = pp_rank*tp + tp_rank)",
    ),
    flag(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="model name reported to clients and in metrics (default: the Hub id, or the "
        "model folder's or file's name); the engine core takes the first of several, the "
        "frontend serves every one (vLLM's aliases)",
    ),
    flag(
        "--tensor-parallel-size",
        "-tp",
        "--tp",
        fills="parallel.tensor_parallel_size",
        type=positive_int,
        default=1,
    ),
    flag(
        "--pipeline-parallel-size",
        "-pp",
        "--pp",
        fills="parallel.pipeline_parallel_size",
        type=positive_int,
        default=1,
    ),
    flag("--enable-expert-parallel", fills="parallel.enable_expert_parallel", action="store_true"),
    flag("--max-model-len", fills="model.max_model_len", type=non_negative_int, default=0),
    flag(
        "--max-num-seqs",
        fills="scheduler.max_num_seqs",
        type=positive_int,
        default=DEFAULT_MAX_NUM_SEQS,
    ),
    flag(
        "--max-num-batched-tokens",
        fills="scheduler.max_num_batched_tokens",
        type=positive_int,
        default=None,
        help="token budget of one engine step (default: vLLM's on CPU, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK} x tp x pp)",
    ),
    flag(
        "--long-prefill-token-threshold",
        fills="scheduler.long_prefill_token_threshold",
        type=non_negative_int,
        default=_SCHEDULER.long_prefill_token_threshold,
    ),
    flag(
        "--prefill-token-budget",
        fills="scheduler.prefill_token_budget",
        type=non_negative_int,
        default=_SCHEDULER.prefill_token_budget,
    ),
    flag(
        "--adaptive-prefill-chunk",
        fills="scheduler.adaptive_prefill_chunk",
        type=non_negative_int,
        default=_SCHEDULER.adaptive_prefill_chunk,
    ),
    flag(
        "--async-scheduling",
        fills="scheduler.async_scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the workers run the current one (vLLM's flag): the "
        "time between steps overlaps the forward; needs --pipeline-parallel-size 1 (default: "
        "on where it can run, as in vLLM)",
    ),
    flag(
        "--speculative-config",
        fills="speculative",
        type=speculative_config,
        default=None,
        help='speculative decoding, as JSON (vLLM\'s flag): {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": M, '
        '"num_speculative_tokens_per_batch_size": [[first, last, K], ...]}; the worker ranks '
        "propose drafts by prompt lookup and verify up to K per request in one forward; without "
        "a per-batch-size schedule a step speculates while at most 8 requests run (an estimated "
        "crossover on CPU: docs/benchmarks.md). Works with --async-scheduling",
    ),
    flag("--runner", fills="model.runner", default="auto"),
    flag("--convert", fills="model.convert", default="auto"),
    flag("--block-size", fills="cache.block_size", type=positive_int, default=16),
    flag(
        "--enable-prefix-caching",
        fills="cache.enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=_CACHE.enable_prefix_caching,
    ),
    flag(
        "--gpu-memory-utilization",
        fills="cache.gpu_memory_utilization",
        type=float,
        default=_CACHE.gpu_memory_utilization,
    ),
    flag(
        "--kv-cache-memory-bytes",
        fills="cache.kv_cache_memory_bytes",
        type=non_negative_int,
        default=0,
    ),
    flag(
        "--kv-transfer-config",
        fills="kv_transfer",
        type=kv_transfer_config,
        default=None,
        help='KV-cache transfer between engines, as JSON (vLLM\'s flag): {"kv_connector": '
        'NAME, "kv_role": "kv_producer" | "kv_consumer" | "kv_both", '
        '"kv_connector_extra_config": {...}, "engine_id": ID, "kv_connector_module_path": '
        "MODULE}; connectors: GrpcConnector (prefill/decode disaggregation, docs/deploy.md)",
    ),
    flag(
        "--dtype",
        fills="model.dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute dtype of the workers (auto: the checkpoint's; float16 runs as float32 on "
        "CPU); half = float16, float = float32",
    ),
    *_filling(
        quantization_flags(),
        {"--quantization": "model.quantization", "--dequantize-gguf": "model.dequantize_gguf"},
    ),
    filling(kv_cache_dtype_flag(), "cache.kv_cache_dtype"),
    flag("--enforce-eager", fills="model.enforce_eager", action="store_true"),
    flag("--disable-sliding-window", fills="model.disable_sliding_window", action="store_true"),
    flag("--seed", fills="model.seed", type=int, default=0),
    flag("--scheduling-policy", fills="scheduler.policy", default=_SCHEDULER.policy),
    flag(
        "--max-num-queued-reqs",
        fills="scheduler.max_num_queued_reqs",
        type=non_negative_int,
        default=0,
    ),
    flag(
        "--max-num-queued-tokens",
        fills="scheduler.max_num_queued_tokens",
        type=non_negative_int,
        default=0,
    ),
    flag(
        "--disable-chunked-mm-input",
        fills="scheduler.disable_chunked_mm_input",
        action="store_true",
    ),
    flag("--attention-backend", fills="model.attention_backend", default="auto"),
    flag("--logprobs-mode", fills="model.logprobs_mode", default="raw_logprobs"),
    flag("--distributed-init-method", fills="parallel.distributed_init_method", default=""),
    flag(
        "--host",
        default=LOOPBACK,
        help="address to listen on (in a pod: its IP, from the downward API)",
    ),
    flag("--port", type=non_negative_int, default=DEFAULT_PORT, help="gRPC port"),
    flag(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (-1 disables)",
    ),
    flag("--engine-id", default="0", help="metrics label `engine`"),
    flag(
        "--worker-connect-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the workers to come up and load",
    ),
    flag(
        "--execute-timeout",
        type=float,
        default=300.0,
        help="seconds the first steps may take, before the engine has learnt its step times",
    ),
    flag(
        "--step-timeout-floor",
        type=float,
        default=5.0,
        help="once step times are known, a step may take this multiple of the recent p99 time "
        "of steps its size, but never less than this many seconds; a rank that misses the "
        "budget counts as hung",
    ),
    flag(
        "--step-timeout-multiple",
        type=float,
        default=10.0,
        help="see --step-timeout-floor",
    ),
    flag(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish (no new ones are "
        "admitted) before they are aborted",
    ),
    flag(
        "--max-recovery-seconds",
        type=float,
        default=120.0,
        help="when a worker rank dies or hangs, keep every request and wait this long for the "
        "ranks to come back (restarted by `splitserve up` or the kubelet), bring them up again "
        "and resume the requests by recompute; past it they fail with UNAVAILABLE and the core "
        "exits non-zero. 0: fail at once (fail-stop)",
    ),
    flag(
        "--structured-outputs-config",
        fills="structured_outputs",
        type=structured_outputs_config,
        default={},
        help='structured outputs, as JSON (vLLM\'s flag): {"backend": "guidance" (llguidance, '
        'the default; "auto" means it; xgrammar is not offered: it needs torch, which the core '
        'never loads), "compile_timeout": seconds a grammar may take to compile before its '
        "request fails (default 10)}",
    ),
    *LORA_FLAGS,
    flag(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between the stats lines (throughput, running and waiting requests, KV "
        "cache usage, prefix cache hit rate) logged while the engine is busy; 0 disables them",
    ),
    flag(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats lines (vLLM's name; same as --log-stats-interval 0)",
    ),
    *LOGGING_FLAGS,
    *internal_tls_flags("the port the frontends call and the calls to the workers"),
    *listener_flags(reflection_default=False),
    *PROFILER_FLAGS,
    *TRACING_FLAGS,
    *NO_EFFECT_FLAGS,
)
"""The flags of `splitserve core`, in --help order (vLLM's names where vLLM has the flag)."""
