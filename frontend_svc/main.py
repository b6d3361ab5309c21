"""frontend_svc entry point: parse flags once, load the tokenizer, connect to the core, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from frontend_svc.async_engine import AsyncEngine
from frontend_svc.config import FrontendConfig, parse_config
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.detokenizer import backend_decoder
from frontend_svc.generation_config import (
    eos_token_ids,
    generation_config_folder,
    log_sampling_defaults,
    read_generation_config,
    sampling_defaults,
)
from frontend_svc.input_processor import InputProcessor, load_tokenizer
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.server import GenerationServicer
from splitserve_contracts import sampling_rules
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.model_source import resolve_model, resolve_tokenizer
from splitserve_runtime.service_host import ServiceHost
from splitserve_runtime.termination import report_fatal

logger = logging.getLogger(__name__)
SERVICE_NAME = "splitserve.frontend.v1.GenerationService"


async def _track_readiness(host: ServiceHost, client: EngineCoreClient) -> None:
    """Readiness follows the stream to the core: NOT_SERVING while it is down."""
    await host.set_ready(client.is_connected)
    while True:
        await host.set_ready(await client.wait_state_change())


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """What the frontend reads from the model: tokenizer and generation config."""

    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]


def load_model_files(config: FrontendConfig) -> ModelFiles:
    """Resolve --model/--tokenizer as the workers do and read the files; ValueError/OSError
    when they cannot be found or read."""
    model = resolve_model(config.model, config.revision)
    source = resolve_tokenizer(model, config.tokenizer, config.revision)
    tokenizer = load_tokenizer(str(source.path))
    folder = None if model.is_gguf else model.path
    generation = read_generation_config(generation_config_folder(config.generation_config, folder))
    defaults = sampling_defaults(generation, config.generation_config)
    try:
        sampling_rules.validate(SamplingParams(**defaults), Limits(vocab_size=len(tokenizer)))
    except sampling_rules.InvalidSamplingParams as err:
        raise ValueError(
            f"the generation config's sampling defaults are invalid ({err}); pass "
            "--generation-config vllm"
        ) from None
    log_sampling_defaults(defaults, config.generation_config)
    return ModelFiles(tokenizer, eos_token_ids(generation), defaults)


async def serve(config: FrontendConfig) -> int:
    try:
        files = load_model_files(config)
    except (ValueError, OSError) as err:
        report_fatal("frontend", str(err))
        return 1
    tokenizer = files.tokenizer
    engine = AsyncEngine(config.core_addr, OutputProcessor(backend_decoder(tokenizer)))
    host = ServiceHost(
        name="frontend",
        host=config.host,
        port=config.port,
        service_names=[SERVICE_NAME],
        metrics_port=config.metrics_port,
    )
    servicer = GenerationServicer(engine, tokenizer)
    gen_grpc.add_GenerationServiceServicer_to_server(servicer, host.server)
    await host.start()
    try:
        info = await engine.start(config.core_connect_timeout)
    except TimeoutError:
        await host.fail(
            f"engine core at {config.core_addr} not reachable after "
            f"{config.core_connect_timeout:.0f} s"
        )
        await host.shutdown()
        return 1
    served_name = config.served_model_name or info.served_model_name
    engine.output_processor.metrics = FrontendMetrics(
        host.registry, served_name, info.engine_id, info.max_model_len
    )
    limits = Limits(
        vocab_size=info.vocab_size,
        max_logprobs=config.max_logprobs,
        max_n=config.max_n,
        max_stop_strings=config.max_stop_strings,
    )
    inputs = InputProcessor(
        tokenizer, info.max_model_len, limits, files.eos_token_ids, files.sampling_defaults
    )
    servicer.attach(inputs, info, served_name)
    logger.info(
        "serving %s (max_model_len %d) via engine core %s",
        info.served_model_name,
        info.max_model_len,
        config.core_addr,
    )
    assert isinstance(engine.client, EngineCoreClient)
    tracker = asyncio.create_task(_track_readiness(host, engine.client))
    code = await host.run_until_stopped()
    tracker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tracker
    await engine.close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "frontend")
    return asyncio.run(serve(config))
