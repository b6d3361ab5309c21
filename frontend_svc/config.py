"""frontend_svc configuration: flags with SPLITSERVE_* environment fallbacks."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from frontend_svc.feature_flags import (
    GATEWAY_FLAGS,
    MEDIA_FLAGS,
    PUBLIC_SECURITY_FLAGS,
    TOOLS_AND_REASONING_FLAGS,
)
from frontend_svc.http_flags import DEFAULT_HTTP_LIMITS, HTTP_LIMIT_FLAGS, HTTP_LOG_FLAGS
from frontend_svc.inputs.chat_template import read_chat_template
from frontend_svc.inputs.media import DEFAULT_MEDIA_LIMITS, MediaLimits
from frontend_svc.kv_events.kv_events_config import KVEventsConfig
from frontend_svc.openai.http_limits import HttpLimits
from frontend_svc.openai.response_store import (
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_RESPONSES_STORE_TTL,
)
from frontend_svc.openai.server import HttpLog
from frontend_svc.openai.tool_parsers import TOOL_PARSERS
from frontend_svc.requests import DEFAULT_MAX_FAN_OUT
from splitserve_runtime.flags import Flag, FlagParser, flag, non_negative_int, positive_int
from splitserve_runtime.listener import DEFAULT_PUBLIC_MAX_RECEIVE_BYTES
from splitserve_runtime.log_config import LOGGING_FLAGS
from splitserve_runtime.model_spec import model_flags
from splitserve_runtime.profiler_config import PROFILER_FLAGS, ProfilerConfig
from splitserve_runtime.services import FRONTEND
from splitserve_runtime.tls import TlsConfigError, TlsFiles
from splitserve_runtime.tracing import TRACING_FLAGS
from splitserve_runtime.transport_flags import (
    TransportConfig,
    check_internal_tls,
    internal_tls_flags,
    listener_flags,
    optional_port,
)
from splitserve_runtime.vllm_compat import NO_EFFECT_FLAGS

DEFAULT_PORT = FRONTEND.default_port
DEFAULT_METRICS_PORT = FRONTEND.default_metrics_port
DEFAULT_HTTP_PORT = 8000
"""The OpenAI-compatible HTTP server's port, as vLLM's."""


@dataclass(frozen=True)
class FrontendConfig(TransportConfig):
    """Everything frontend_svc needs, parsed once at start-up."""

    model: str
    core_addr: str
    tokenizer: str = ""
    revision: str = ""
    generation_config: str = "auto"
    served_model_name: tuple[str, ...] = ()
    """--served-model-name: the names clients may use, the first one reported (empty: the
    engine core's)."""
    chat_template: str = ""
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    http_host: str = ""
    http_port: int | None = DEFAULT_HTTP_PORT
    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 32
    core_connect_timeout: float = 900.0
    shutdown_timeout: float = 30.0
    max_inflight_requests: int = 0
    max_fan_out: int = DEFAULT_MAX_FAN_OUT
    max_recovery_seconds: float = 120.0
    enable_log_requests: bool = False
    max_log_len: int = 0
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    log_level: str = "info"
    log_format: str = "text"
    api_key: str = field(default="", repr=False)
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_ca_certs: str = ""
    max_receive_message_bytes: int = DEFAULT_PUBLIC_MAX_RECEIVE_BYTES
    timeout_keep_alive: float = DEFAULT_HTTP_LIMITS.timeout_keep_alive
    http_header_timeout: float = DEFAULT_HTTP_LIMITS.header_timeout
    http_body_timeout: float = DEFAULT_HTTP_LIMITS.body_timeout
    max_http_connections: int = DEFAULT_HTTP_LIMITS.max_connections
    limit_mm_per_prompt: int = DEFAULT_MEDIA_LIMITS.max_images_per_prompt
    max_image_bytes: int = DEFAULT_MEDIA_LIMITS.max_image_bytes
    max_image_pixels: int = DEFAULT_MEDIA_LIMITS.max_image_pixels
    max_image_side: int = DEFAULT_MEDIA_LIMITS.max_image_side
    max_image_aspect_ratio: float = DEFAULT_MEDIA_LIMITS.max_image_aspect_ratio
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = DEFAULT_MEDIA_LIMITS.media_fetch_timeout
    mm_processor_threads: int = DEFAULT_MEDIA_LIMITS.mm_processor_threads
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    data_parallel_rank: int = 0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    responses_store_ttl: float = DEFAULT_RESPONSES_STORE_TTL
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    otlp_traces_endpoint: str = ""
    collect_detailed_traces: list[str] = field(default_factory=list)
    enable_reflection: bool = field(default=True, kw_only=True)

    @property
    def media_limits(self) -> MediaLimits:
        """Bounds on images (multimodal models)."""
        return MediaLimits(
            max_images_per_prompt=self.limit_mm_per_prompt,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_image_side=self.max_image_side,
            max_image_aspect_ratio=self.max_image_aspect_ratio,
            allowed_media_domains=self.allowed_media_domains,
            media_fetch_timeout=self.media_fetch_timeout,
            mm_processor_threads=self.mm_processor_threads,
        )

    @property
    def http_limits(self) -> HttpLimits:
        """The HTTP port's timeouts, connection cap and body limit."""
        return HttpLimits(
            timeout_keep_alive=self.timeout_keep_alive,
            header_timeout=self.http_header_timeout,
            body_timeout=self.http_body_timeout,
            max_connections=self.max_http_connections,
            max_body_bytes=self.max_receive_message_bytes,
        )

    @property
    def http_log(self) -> HttpLog:
        """What the HTTP server logs."""
        return HttpLog(
            level=self.uvicorn_log_level,
            access_log=not self.disable_uvicorn_access_log,
            quiet_paths=self.disable_access_log_for_endpoints,
        )

    @property
    def ssl(self) -> TlsFiles | None:
        """TLS of the public port (None: plaintext)."""
        if not self.ssl_certfile:
            return None
        return TlsFiles(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)


FRONTEND_FLAGS: tuple[Flag, ...] = (
    *model_flags(is_frontend=True),
    flag("--core-addr", default="127.0.0.1:50061", help="engine core HOST:PORT"),
    flag(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="model names clients may send (vLLM's aliases): /v1/models lists each, responses "
        "and metrics carry the first (default: what the engine core reports)",
    ),
    flag(
        "--chat-template",
        type=read_chat_template,
        default="",
        help="a Jinja chat template file, or the template itself, used instead of the "
        "model's own (vLLM's flag)",
    ),
    flag("--host", default="0.0.0.0", help="address to listen on"),
    flag("--port", type=non_negative_int, default=DEFAULT_PORT, help="gRPC port"),
    flag(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (-1 disables)",
    ),
    flag("--http-host", default="", help="OpenAI HTTP server address (default: same as --host)"),
    flag(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="OpenAI-compatible HTTP port (/v1/completions, /health, /metrics; -1 disables)",
    ),
    flag(
        "--max-logprobs",
        type=non_negative_int,
        default=20,
        help="largest logprobs / prompt_logprobs a request may ask for",
    ),
    flag("--max-n", type=positive_int, default=64, help="largest n a request may ask for"),
    flag("--max-stop-strings", type=positive_int, default=32, help="most stop strings per request"),
    flag(
        "--core-connect-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the engine core at start-up",
    ),
    flag(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish (new ones are refused "
        "with UNAVAILABLE) before they are aborted",
    ),
    flag(
        "--max-inflight-requests",
        type=non_negative_int,
        default=0,
        help="most engine requests this frontend streams at once (n > 1 counts n); more are "
        "refused at once with RESOURCE_EXHAUSTED (0: unlimited)",
    ),
    flag(
        "--max-fan-out",
        type=positive_int,
        default=DEFAULT_MAX_FAN_OUT,
        help="most engine requests one call may make: prompts x n on /v1/completions, n "
        "elsewhere (at least --max-n); more are refused at once with a 400",
    ),
    flag(
        "--max-recovery-seconds",
        type=float,
        default=120.0,
        help="when the stream to the engine core breaks (the core restarts), requests in flight "
        "wait this long for it to come back and are then resubmitted with the tokens they have "
        "so far; past it they fail with UNAVAILABLE. 0: fail at once",
    ),
    flag(
        "--enable-log-requests",
        action="store_true",
        help="log one line per finished request: id, prompt and output token counts, finish "
        "reason, latency (never the prompt, unless --max-log-len)",
    ),
    flag(
        "--max-log-len",
        type=non_negative_int,
        default=0,
        help="with --enable-log-requests, also log the first this-many characters of each "
        "prompt (vLLM's name; 0, the default here, logs no prompt text)",
    ),
    *LOGGING_FLAGS,
    *HTTP_LOG_FLAGS,
    *HTTP_LIMIT_FLAGS,
    *MEDIA_FLAGS,
    *GATEWAY_FLAGS,
    *TOOLS_AND_REASONING_FLAGS,
    *PUBLIC_SECURITY_FLAGS,
    *internal_tls_flags("the calls to the engine core"),
    *listener_flags(reflection_default=True),
    *PROFILER_FLAGS,
    *TRACING_FLAGS,
    *NO_EFFECT_FLAGS,
)
"""The flags of `splitserve frontend`, in --help order (vLLM's names where vLLM has the flag)."""


def build_parser() -> FlagParser:
    return FlagParser.of_service(
        "splitserve frontend", "Run the public gRPC frontend (vLLM's P0).", FRONTEND_FLAGS
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> FrontendConfig:
    env = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse(argv, env)
    check_internal_tls(parser, args)
    if args.max_recovery_seconds < 0:
        parser.error("--max-recovery-seconds must be >= 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(
            "--enable-auto-tool-choice requires --tool-call-parser (one of "
            f"{', '.join(sorted(TOOL_PARSERS))})"
        )
    if args.max_fan_out < args.max_n:
        parser.error("--max-fan-out must be at least --max-n (one call's n fans out n requests)")
    try:
        TlsFiles.from_flags(
            args.ssl_certfile,
            args.ssl_keyfile,
            args.ssl_ca_certs,
            needs_ca=False,
            flag_names="--ssl-certfile and --ssl-keyfile (and optionally --ssl-ca-certs)",
        )
    except TlsConfigError as err:
        parser.error(str(err))
    values = vars(args)
    values.pop("config", None)
    values["metrics_port"] = None if args.metrics_port < 0 else args.metrics_port
    values["health_port"] = optional_port(args.health_port)
    values["http_port"] = None if args.http_port < 0 else args.http_port
    values["http_host"] = args.http_host or args.host
    values["api_key"] = args.api_key or env.get("VLLM_API_KEY", "")
    values["served_model_name"] = tuple(dict.fromkeys(args.served_model_name))
    values["uvicorn_log_level"] = args.uvicorn_log_level or args.log_level
    return FrontendConfig(**values)
