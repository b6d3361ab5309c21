"""frontend_svc configuration: flags with SPLITSERVE_* environment fallbacks."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int
from splitserve_runtime.log_config import LOG_LEVELS
from splitserve_runtime.model_source import add_model_arguments

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9400


@dataclass(frozen=True)
class FrontendConfig:
    """Everything frontend_svc needs, parsed once at start-up."""

    model: str
    core_addr: str
    tokenizer: str = ""
    revision: str = ""
    generation_config: str = "auto"
    served_model_name: str = ""
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 32
    core_connect_timeout: float = 900.0
    log_level: str = "info"


def build_parser() -> FlagParser:
    p = FlagParser(
        prog="splitserve frontend", description="Run the public gRPC frontend (vLLM's P0)."
    )
    add_model_arguments(p, is_frontend=True)
    p.add_argument("--core-addr", default="127.0.0.1:50061", help="engine core HOST:PORT")
    p.add_argument(
        "--served-model-name",
        default="",
        help="model name for clients (default: what the engine core reports)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=non_negative_int, default=DEFAULT_PORT, help="gRPC port")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (-1 disables)",
    )
    p.add_argument(
        "--max-logprobs",
        type=non_negative_int,
        default=20,
        help="largest logprobs / prompt_logprobs a request may ask for",
    )
    p.add_argument("--max-n", type=positive_int, default=64, help="largest n a request may ask for")
    p.add_argument(
        "--max-stop-strings", type=positive_int, default=32, help="most stop strings per request"
    )
    p.add_argument(
        "--core-connect-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the engine core at start-up",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return p


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> FrontendConfig:
    args = build_parser().parse(argv, os.environ if environ is None else environ)
    values = vars(args)
    values["metrics_port"] = None if args.metrics_port < 0 else args.metrics_port
    return FrontendConfig(**values)
