"""Flags of vLLM 0.32's `vllm serve` that deployment templates pass (production-stack, llm-d,
KServe) and that change nothing here: accepted, each warned about once per process ("has no
effect here: why"), never passed on. A flag whose value would change results is refused by name
(RefuseFlag, or `only_values` for a value), and a flag vLLM itself no longer has stays unknown
(an error, as in vLLM). tests/fixtures/vllm_0_32_serve_flags.txt lists vLLM 0.32's flags.

Every service's table and the launcher's carry NO_EFFECT_FLAGS: `splitserve serve` warns once
and passes none of them on; `splitserve core|frontend|worker` (the chart's extraArgs) accept them
too.
"""

from __future__ import annotations

from typing import Any

from splitserve_runtime.flags import Flag, NoEffectFlag, flag, only_values

TRUST_REMOTE_CODE_NOTE = (
    "splitserve never runs code from a model repository; it serves the architectures it "
    "implements itself (docs/models.md) and refuses any other when the model loads, with or "
    "without this flag"
)


def _no_effect(*names: str, why: str, takes_value: bool = False, **settings: Any) -> Flag:
    if takes_value:
        settings.setdefault("nargs", None)
        settings.setdefault("metavar", "VALUE")
    return flag(*names, action=NoEffectFlag, help=why, **settings)


NO_EFFECT_FLAGS: tuple[Flag, ...] = (
    _no_effect(
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        why="prefills are always chunked (vLLM V1's default): each step spends "
        "--max-num-batched-tokens, and chunking never changes a request's tokens",
    ),
    _no_effect("--trust-remote-code", "--no-trust-remote-code", why=TRUST_REMOTE_CODE_NOTE),
    _no_effect(
        "--disable-custom-all-reduce",
        "--no-disable-custom-all-reduce",
        why="tensor-parallel all-reduce is torch.distributed's (gloo on CPU, NCCL on GPU)",
    ),
    _no_effect(
        "--distributed-executor-backend",
        why="every rank is its own process (started by `splitserve serve` or the chart) and the "
        "engine core drives them over gRPC",
        takes_value=True,
    ),
    _no_effect(
        "--max-parallel-loading-workers",
        why="each rank loads its own shard of the weights",
        takes_value=True,
    ),
    _no_effect(
        "--compilation-config",
        "-cc",
        why="workers compile what they compile themselves (--enforce-eager: nothing)",
        takes_value=True,
    ),
    _no_effect(
        "--optimization-level",
        why="workers compile what they compile themselves (--enforce-eager: nothing)",
        takes_value=True,
    ),
    _no_effect(
        "--cudagraph-capture-sizes",
        why="the workers choose their CUDA-graph batch sizes (--enforce-eager: none)",
        takes_value=True,
        nargs="+",
    ),
    _no_effect(
        "--max-cudagraph-capture-size",
        why="the workers choose their CUDA-graph batch sizes (--enforce-eager: none)",
        takes_value=True,
    ),
    _no_effect(
        "--download-dir",
        why="downloads go to SPLITSERVE_CACHE_DIR (or the Hugging Face cache, HF_HOME)",
        takes_value=True,
    ),
    _no_effect(
        "--load-format",
        why="the format is read from the checkpoint (safetensors or GGUF)",
        takes_value=True,
        type=only_values(
            "auto", "safetensors", "gguf", why="the weights are read as the checkpoint has them"
        ),
    ),
    _no_effect(
        "--tokenizer-mode",
        why="the checkpoint's Hugging Face tokenizer is used",
        takes_value=True,
        type=only_values("auto", "hf", why="other tokenizers would tokenize differently"),
    ),
    _no_effect(
        "--enable-request-id-headers",
        "--no-enable-request-id-headers",
        why="every response carries X-Request-Id",
    ),
    _no_effect(
        "--disable-fastapi-docs",
        "--no-disable-fastapi-docs",
        why="no OpenAPI schema or docs pages are served",
    ),
    _no_effect(
        "--show-hidden-metrics-for-version",
        why="no metric is hidden",
        takes_value=True,
    ),
)
"""vLLM 0.32 flags accepted with no effect (warned once each)."""
