"""frontend_svc entry point: parse flags once, load the tokenizer, connect to the core, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from frontend_svc.async_engine import AsyncEngine
from frontend_svc.config import FrontendConfig, parse_config
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.detokenizer import backend_decoder
from frontend_svc.grpc_auth import api_key_interceptors
from frontend_svc.input_processor import InputProcessor, generation_eos_ids, load_tokenizer
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.server import GenerationServicer
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.sampling_rules import Limits
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.listener import public_listener
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.service_host import ServiceHost
from splitserve_runtime.services import FRONTEND
from splitserve_runtime.tls import CORE_ROLE

logger = logging.getLogger(__name__)


async def _track_readiness(host: ServiceHost, client: EngineCoreClient) -> None:
    """Readiness follows the stream to the core: NOT_SERVING while it is down."""
    await host.set_ready(client.is_connected)
    while True:
        await host.set_ready(await client.wait_state_change())


async def serve(config: FrontendConfig) -> int:
    """Connect to the engine core first (as vLLM's API server waits for its engine), then build
    every piece complete and open the public port."""
    model = config.model
    if not model:
        from splitserve_runtime.default_model import ensure_default_model

        model = str(ensure_default_model())
    tokenizer = load_tokenizer(model)
    client = EngineCoreClient(config.core_addr, security=ChannelSecurity(config.tls, CORE_ROLE))
    try:
        info = await client.connect(config.core_connect_timeout)
    except TimeoutError:
        logger.error(
            "engine core at %s not reachable after %.0f s",
            config.core_addr,
            config.core_connect_timeout,
        )
        await client.close()
        return 1
    host = ServiceHost(
        name="frontend",
        host=config.host,
        port=config.port,
        service_names=[FRONTEND.grpc_service],
        metrics_port=config.metrics_port,
        listener=public_listener(
            ssl=config.ssl,
            max_receive_message_bytes=config.max_receive_message_bytes,
            interceptors=api_key_interceptors(config.api_key),
            enable_reflection=config.enable_reflection,
            health_port=config.health_port,
        ),
    )
    served_name = config.served_model_name or info.served_model_name
    metrics = FrontendMetrics(host.registry, served_name, info.engine_id, info.max_model_len)
    engine = AsyncEngine(client, OutputProcessor(backend_decoder(tokenizer), metrics), metrics)
    limits = Limits(
        vocab_size=info.vocab_size,
        max_logprobs=config.max_logprobs,
        max_n=config.max_n,
        max_stop_strings=config.max_stop_strings,
    )
    inputs = InputProcessor(tokenizer, info.max_model_len, limits, generation_eos_ids(model))
    servicer = GenerationServicer(engine, inputs, info, served_name)
    gen_grpc.add_GenerationServiceServicer_to_server(servicer, host.server)
    await host.start()
    engine.start()
    logger.info(
        "serving %s (max_model_len %d) via engine core %s",
        info.served_model_name,
        info.max_model_len,
        config.core_addr,
    )
    tracker = asyncio.create_task(_track_readiness(host, client))
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
