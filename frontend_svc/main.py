"""frontend_svc entry point: parse flags once, read the model's files, connect to the core, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from smg_grpc_proto import vllm_engine_pb2_grpc

from frontend_svc.assembly import Frontend, FrontendLimits, build_frontend
from frontend_svc.auth.grpc_auth import api_key_interceptors
from frontend_svc.config import FrontendConfig, parse_config
from frontend_svc.engine.core_client import EngineCoreClient
from frontend_svc.engine.engine_stats import EngineView
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.engine.request_log import RequestLogger
from frontend_svc.gateway import convert as gateway_convert
from frontend_svc.gateway.servicer import VllmEngineServicer
from frontend_svc.inputs.model_files import ModelFiles, load_model_files
from frontend_svc.kv_events.hub import KvEventHub
from frontend_svc.kv_events.kv_publisher import ZmqEventPublisher
from frontend_svc.openai.app import build_app
from frontend_svc.openai.chat_output import ChatFeatures, tool_markers_are_special
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.harmony import require_harmony_encoding
from frontend_svc.openai.ops_routes import OpsOptions
from frontend_svc.openai.reasoning import ReasoningParser
from frontend_svc.openai.response_store import ResponseStore
from frontend_svc.openai.server import HttpServer
from frontend_svc.openai.tool_parsers import TOOL_PARSERS
from frontend_svc.requests import DEFAULT_MAX_FAN_OUT
from frontend_svc.server import AdminServicer, GenerationServicer
from frontend_svc.serving.classification import ClassifierHead
from frontend_svc.serving.served_models import ServedModels, runtime_lora_updating
from frontend_svc.tracing import accept_caller_traces
from splitserve_contracts.frontend.v1 import admin_service_pb2
from splitserve_contracts.frontend.v1 import admin_service_pb2_grpc as admin_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.flags import SECRET_DESTS
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.listener import public_listener
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.service_host import ServiceHost, new_registry
from splitserve_runtime.services import FRONTEND
from splitserve_runtime.termination import report_fatal
from splitserve_runtime.tls import CORE_ROLE
from splitserve_runtime.tracing import Tracing, start_tracing

logger = logging.getLogger(__name__)
ADMIN_SERVICE = admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


async def _track_readiness(host: ServiceHost, client: EngineCoreClient) -> None:
    """Readiness follows the stream to the core: NOT_SERVING while it is down."""
    await host.set_ready(client.is_connected)
    while True:
        await host.set_ready(await client.wait_state_change())


def read_model_files(config: FrontendConfig) -> ModelFiles:
    """The tokenizer and generation config that --model, --revision, --tokenizer and
    --generation-config name."""
    return load_model_files(
        config.model,
        config.revision,
        config.tokenizer,
        config.generation_config,
        config.media_limits,
        config.chat_template,
    )


async def serve(config: FrontendConfig) -> int:
    """Read the model's files, connect to the engine core (as vLLM's API server waits for its
    engine), then build every piece complete and open the public port."""
    try:
        files = read_model_files(config)
        chat = chat_features(config, files.tokenizer)
    except (ValueError, OSError) as err:
        report_fatal("frontend", str(err))
        return 1
    registry = new_registry()
    client = core_client(config, files, registry)
    try:
        info = await client.connect(config.core_connect_timeout)
    except TimeoutError:
        report_fatal(
            "frontend",
            f"engine core at {config.core_addr} not reachable after "
            f"{config.core_connect_timeout:.0f} s",
        )
        await client.close()
        return 1
    host = public_host(config, registry)
    try:  # the ZMQ endpoints of --kv-events-config, then the OTLP exporter
        hub, publisher = kv_event_hub(config, info.options.cache.block_size)
        tracing = start_tracing(
            "frontend", config.otlp_traces_endpoint, config.collect_detailed_traces
        )
    except ValueError as err:
        report_fatal("frontend", str(err))
        await client.close()
        return 1
    if tracing is not None:
        accept_caller_traces()
    parts, http = await assemble(config, client, info, files, chat, host, hub, tracing)
    code = await run_until_stopped(config, host, parts, http, client)
    if publisher is not None:
        publisher.close()
    if tracing is not None:
        tracing.shutdown()  # the spans still batched
    return code


def core_client(
    config: FrontendConfig, files: ModelFiles, registry: CollectorRegistry
) -> EngineCoreClient:
    """The client of the engine core at --core-addr (not connected yet)."""
    return EngineCoreClient(
        config.core_addr,
        security=ChannelSecurity(config.tls, CORE_ROLE, config.internal_secret),
        tokenizer=files.tokenizer_info,
        subscribe_kv_events=config.kv_events_config.enable_kv_cache_events,
        grpc_metrics=GrpcClientMetrics(registry),
    )


async def assemble(
    config: FrontendConfig,
    client: EngineCoreClient,
    info: EngineInfo,
    files: ModelFiles,
    chat: ChatFeatures,
    host: ServiceHost,
    hub: KvEventHub | None,
    tracing: Tracing | None,
) -> tuple[Frontend, HttpServer | None]:
    """The engine and its servicers on `host`, and the HTTP API (None: --http-port -1); nothing
    started yet."""
    served_name, *aliases = config.served_model_name or (info.served_model_name,)
    limits = FrontendLimits(
        config.max_logprobs,
        config.max_n,
        config.max_stop_strings,
        config.max_inflight_requests,
        config.max_recovery_seconds,
    )
    parts = build_frontend(client, info, files, host.registry, served_name, limits, hub, tracing)
    models = ServedModels(
        client, served_name, info, runtime_lora_updating(os.environ), tuple(aliases)
    )
    await models.refresh()
    if config.enable_log_requests:
        parts.engine.request_logger = RequestLogger(files.tokenizer, config.max_log_len)
    add_servicers(
        host,
        parts,
        files,
        client,
        hub,
        config.data_parallel_rank,
        chat,
        tuple(aliases),
        config.profiler_config.is_enabled,
        config.max_fan_out,
        models,
    )
    if config.http_port is None:
        return parts, None
    classifier = ClassifierHead.from_config(files.model_config)
    http = http_server(config, parts, host, client, chat, tuple(aliases), models, classifier)
    return parts, http


async def run_until_stopped(
    config: FrontendConfig,
    host: ServiceHost,
    parts: Frontend,
    http: HttpServer | None,
    client: EngineCoreClient,
) -> int:
    """Open the ports and start the engine; on shutdown, drain and close it. The exit code."""
    engine, info = parts.engine, parts.info
    await host.start()
    engine.start()
    if http is not None:
        try:
            await http.start()
        except OSError as err:
            await host.fail(f"HTTP server: {err}")
    logger.info(
        "serving %s (max_model_len %d) via engine core %s",
        info.served_model_name,
        info.max_model_len,
        config.core_addr,
    )
    tracker = asyncio.create_task(_track_readiness(host, client))

    async def drain() -> None:
        await engine.drain(config.shutdown_timeout)
        if http is not None:
            await http.stop()

    code = await host.run_until_stopped(on_shutdown=drain)
    tracker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tracker
    await engine.close()
    return code


def public_host(config: FrontendConfig, registry: CollectorRegistry) -> ServiceHost:
    """The public gRPC server (not started): the public API, the admin service and the gateway
    contract, behind the API key."""
    public_services = [FRONTEND.grpc_service, ADMIN_SERVICE, gateway_convert.SERVICE_NAME]
    return ServiceHost(
        name="frontend",
        host=config.host,
        port=config.port,
        service_names=public_services,
        metrics_port=config.metrics_port,
        grace_seconds=config.shutdown_timeout + 5.0,
        listener=public_listener(
            ssl=config.ssl,
            max_receive_message_bytes=config.max_receive_message_bytes,
            interceptors=api_key_interceptors(config.api_key, public_services),
            enable_reflection=config.enable_reflection,
            health_port=config.health_port,
        ),
        registry=registry,
    )


def http_server(
    config: FrontendConfig,
    parts: Frontend,
    host: ServiceHost,
    client: EngineCoreClient,
    chat: ChatFeatures,
    aliases: tuple[str, ...],
    models: ServedModels,
    classifier: ClassifierHead,
) -> HttpServer:
    """The OpenAI-compatible HTTP API (not started)."""
    engine, info, served_name = parts.engine, parts.info, parts.served_model_name
    context = ServingContext(
        engine,
        parts.inputs,
        info,
        served_name,
        time.time(),
        max_fan_out=config.max_fan_out,
        max_body_bytes=config.max_receive_message_bytes,
        chat=chat,
        model_aliases=aliases,
        models=models,
        classifier=classifier,
    )
    engine_view = EngineView(
        client.engine_snapshot, lambda: engine.scheduler_stats, served_name, info
    )
    store = ResponseStore(config.responses_store_size, config.responses_store_ttl)
    app = build_app(
        context,
        host.registry,
        config.api_key,
        store,
        engine_view.render,
        ops_options(config, client),
    )
    return HttpServer(
        app,
        config.http_host,
        config.http_port or 0,
        config.http_log,
        config.ssl,
        config.http_limits,
    )


def ops_options(config: FrontendConfig, client: EngineCoreClient) -> OpsOptions:
    """vLLM's operator routes as the flags (and VLLM_SERVER_DEV_MODE) turn them on."""
    settings = None
    if os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1":
        settings = {k: v for k, v in vars(config).items() if k not in SECRET_DESTS}
    return OpsOptions(
        track_load=config.enable_server_load_tracking,
        tokenizer_info=config.enable_tokenizer_info_endpoint,
        server_info=settings,
        profiler=client if config.profiler_config.is_enabled else None,
    )


def kv_event_hub(
    config: FrontendConfig, block_size: int
) -> tuple[KvEventHub | None, ZmqEventPublisher | None]:
    """The engine's KV-cache events as --kv-events-config asks: their hub (None: off) and its
    ZMQ publisher (None: gRPC only). ValueError when the ZMQ endpoints cannot be opened."""
    kv_config = config.kv_events_config
    if not kv_config.enable_kv_cache_events:
        return None, None
    publisher = None
    if kv_config.publishes_zmq:
        publisher = ZmqEventPublisher(kv_config, config.data_parallel_rank, block_size)
    return KvEventHub(block_size, sinks=[publisher] if publisher else []), publisher


def add_servicers(
    host: ServiceHost,
    parts: Frontend,
    files: ModelFiles,
    client: EngineCoreClient,
    hub: KvEventHub | None,
    data_parallel_rank: int,
    chat: ChatFeatures,
    model_aliases: tuple[str, ...] = (),
    profiling: bool = False,
    max_fan_out: int = DEFAULT_MAX_FAN_OUT,
    models: ServedModels | None = None,
) -> None:
    """The public API and its admin service and, beside them on the same port, the gateway
    contract."""
    engine, inputs, info, name = parts.engine, parts.inputs, parts.info, parts.served_model_name
    servicer = GenerationServicer(
        engine, inputs, info, name, chat, model_aliases, max_fan_out, models
    )
    gen_grpc.add_GenerationServiceServicer_to_server(servicer, host.server)
    if models is not None:
        admin_grpc.add_AdminServiceServicer_to_server(AdminServicer(models), host.server)
    profiler = client if profiling else None
    gateway = VllmEngineServicer(
        engine, inputs, info, files, name, hub, client, data_parallel_rank, profiler
    )
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(gateway, host.server)


def chat_features(config: FrontendConfig, tokenizer: object) -> ChatFeatures:
    """The tool and reasoning settings, checked against the tokenizer (a reasoning parser
    whose think tokens the vocabulary lacks raises ValueError)."""
    reasoning = None
    if config.reasoning_parser is not None:
        reasoning = ReasoningParser(config.reasoning_parser, tokenizer)
    parser = config.tool_call_parser
    if parser is not None and TOOL_PARSERS[parser].reads_whole_text:
        require_harmony_encoding(f"--tool-call-parser {parser}")
    return ChatFeatures(
        config.tool_call_parser,
        config.enable_auto_tool_choice,
        reasoning,
        tool_markers_are_special(config.tool_call_parser, tokenizer),
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "frontend", config.log_format)
    return asyncio.run(serve(config))
