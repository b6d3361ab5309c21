"""vLLM's operator routes: /load, /server_info, /tokenizer_info, /start_profile and
/stop_profile, each on vLLM's terms.

- /load: `{"server_load": N}`, N the generation requests in flight on this HTTP API while
  --enable-server-load-tracking is on (else 0), as vLLM counts them.
- /server_info: only with VLLM_SERVER_DEV_MODE=1 (vLLM's development routes): the frontend's
  settings (no secrets), the engine's facts, the VLLM_* environment (no *KEY*) and the system.
- /tokenizer_info: only with --enable-tokenizer-info-endpoint: the tokenizer's configuration and
  chat template.
- /start_profile, /stop_profile: only with --profiler-config (a torch profiler): the torch
  profiler on every worker rank, through the engine core (`profile_prefix` names the session).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Protocol

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend_svc.errors import EngineUnavailable, InvalidRequest
from frontend_svc.openai.fields import read_json
from frontend_svc.openai.generation import ServingContext

Handler = Callable[[Request], Awaitable[Response]]
Route = tuple[str, list[str], Handler, bool]
"""(path, methods, handler, is_protected by --api-key)."""
PROFILE_START, PROFILE_STOP = 1, 2


class ProfileControl(Protocol):
    async def profile(self, action: int, prefix: str, timeout: float = 60.0) -> None: ...


@dataclass(frozen=True)
class OpsOptions:
    """Which of the routes are on (vLLM's flags)."""

    track_load: bool = False
    tokenizer_info: bool = False
    server_info: Mapping[str, Any] | None = None
    """What /server_info shows about this frontend (None: the route is off)."""
    profiler: ProfileControl | None = None


NO_OPS = OpsOptions()
"""Every optional route off; /load always answers (0 when not tracking)."""


@dataclass
class ServerLoad:
    """Generation requests in flight on the HTTP API (vLLM's server_load_metrics)."""

    is_tracking: bool = False
    value: int = field(default=0)

    async def track(self, handle: Handler, request: Request) -> Response:
        """`handle(request)`, counted until its response (a stream: its last chunk) is sent."""
        if not self.is_tracking:
            return await handle(request)
        self.value += 1
        try:
            response = await handle(request)
        except BaseException:
            self.value -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._counted(response.body_iterator)
        else:
            self.value -= 1
        return response

    async def _counted(self, chunks: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.value -= 1


def ops_routes(ctx: ServingContext, options: OpsOptions, load: ServerLoad) -> list[Route]:
    async def server_load(request: Request) -> Response:
        return JSONResponse({"server_load": load.value})

    routes: list[Route] = [("/load", ["GET"], server_load, False)]
    if options.server_info is not None:
        routes.append(("/server_info", ["GET"], _server_info(ctx, options.server_info), True))
    if options.tokenizer_info:
        routes.append(("/tokenizer_info", ["GET"], _tokenizer_info(ctx), True))
    if options.profiler is not None:
        start, stop = _profile_routes(ctx, options.profiler)
        routes += [
            ("/start_profile", ["POST"], start, True),
            ("/stop_profile", ["POST"], stop, True),
        ]
    return routes


def _server_info(ctx: ServingContext, settings: Mapping[str, Any]) -> Handler:
    async def server_info(request: Request) -> Response:
        info = {
            "splitserve_config": {"frontend": dict(settings), "engine": _engine_facts(ctx)},
            "vllm_env": {
                k: v
                for k, v in sorted(os.environ.items())
                if k.startswith("VLLM_") and "KEY" not in k
            },
            "system_env": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "splitserve": metadata.version("splitserve"),
            },
        }
        if request.query_params.get("config_format", "text") == "text":
            info["splitserve_config"] = json.dumps(info["splitserve_config"], default=str)
        return JSONResponse(info)

    return server_info


def _engine_facts(ctx: ServingContext) -> dict[str, Any]:
    """The engine's facts and options, less where its files and ranks are (never disclosed)."""
    facts = asdict(ctx.info)
    del facts["options"]["model"]["model"], facts["options"]["parallel"]["distributed_init_method"]
    return facts


def _tokenizer_info(ctx: ServingContext) -> Handler:
    async def tokenizer_info(request: Request) -> Response:
        """vLLM's TokenizerInfo: init kwargs (no file paths), class, chat template."""
        tokenizer = ctx.tokenizer
        config = dict(getattr(tokenizer, "init_kwargs", None) or {})
        for path_field in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
            config.pop(path_field, None)
        config = json.loads(json.dumps(config, default=str))
        config["tokenizer_class"] = type(tokenizer).__name__
        template = getattr(tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return JSONResponse(config)

    return tokenizer_info


def _profile_routes(ctx: ServingContext, profiler: ProfileControl) -> tuple[Handler, Handler]:
    async def run(action: int, prefix: str) -> Response:
        try:
            await profiler.profile(action, prefix)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(err.details() or "bad profile request") from None
            raise EngineUnavailable("the engine core did not run the profiler", str(err)) from None
        return Response(status_code=200)

    async def start_profile(request: Request) -> Response:
        """vLLM's optional body: profile_prefix (delay and max iterations are not offered)."""
        headers = request.headers
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        body = await read_json(request, ctx.max_body_bytes) if has_body else {}
        for name in ("delay_iterations", "max_iterations"):
            if body.get(name):
                raise InvalidRequest(f"{name} is not available here; send 0 or leave it out", name)
        prefix = body.get("profile_prefix") or ""
        if not isinstance(prefix, str):
            raise InvalidRequest("profile_prefix must be a string", "profile_prefix")
        return await run(PROFILE_START, prefix)

    async def stop_profile(request: Request) -> Response:
        return await run(PROFILE_STOP, "")

    return start_profile, stop_profile
