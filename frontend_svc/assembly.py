"""The frontend's engine assembled from its parts, once the engine core's facts are known: the
frontend service (main.py) and the in-process engine of the offline `LLM` API build it the same
way."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.core_client import CoreClient
from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.inputs.model_files import ModelFiles
from frontend_svc.kv_events.hub import KvEventHub
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.tracing import RequestTracer
from splitserve_contracts.sampling_rules import Limits
from splitserve_runtime.tracing import Tracing


@dataclass(frozen=True)
class FrontendLimits:
    """Bounds on what one request may ask for (the frontend's flags)."""

    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 32
    max_inflight_requests: int = 0
    max_recovery_seconds: float = 0.0
    """How long requests in flight wait for a lost engine core to come back."""


@dataclass(frozen=True)
class Frontend:
    """A frontend's engine and input processor, complete; start the engine on the serving loop."""

    engine: AsyncEngine
    inputs: InputProcessor
    info: EngineInfo
    served_model_name: str


def build_frontend(
    client: CoreClient,
    info: EngineInfo,
    files: ModelFiles,
    registry: CollectorRegistry,
    served_model_name: str,
    limits: FrontendLimits = FrontendLimits(),
    kv_events: KvEventHub | None = None,
    tracing: Tracing | None = None,
) -> Frontend:
    """Metrics (with the engine core's queue and KV gauges), engine and input processor (with
    the model's image processor when the engine says it takes images); `kv_events` gets the
    engine's KV-cache events (when the client subscribed to them)."""
    """Metrics (the request-level series; the engine's own are the core's), engine and input
    processor;
    `kv_events` gets the engine's KV-cache events (when the client subscribed to them)."""
    metrics = FrontendMetrics(registry, served_model_name, info.engine_id, info.max_model_len)
    tracer = RequestTracer(tracing, served_model_name) if tracing is not None else None
    engine = AsyncEngine(
        client,
        OutputProcessor(backend_decoder(files.tokenizer), metrics, tracer),
        metrics,
        limits.max_inflight_requests,
        limits.max_recovery_seconds,
        kv_events,
        tracer,
    )
    request_limits = Limits(
        vocab_size=info.vocab_size,
        max_logprobs=limits.max_logprobs,
        max_n=limits.max_n,
        max_stop_strings=limits.max_stop_strings,
    )
    inputs = InputProcessor(
        files.tokenizer,
        info.max_model_len,
        request_limits,
        files.eos_token_ids,
        files.sampling_defaults,
        multimodal=files.multimodal_processor(info.max_tokens_per_mm_item),
    )
    return Frontend(engine, inputs, info, served_model_name)
