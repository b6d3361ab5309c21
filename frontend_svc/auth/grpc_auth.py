"""The public gRPC API's key check: a grpc.aio server interceptor in front of every call of the
public services (GenerationService, and the gateway contract's VllmEngine; health and reflection
stay open, as in vLLM, so probes and tools work without the key). The check itself is frontend_svc/auth/api_key.py's, shared with the HTTP API."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc

from frontend_svc.auth.api_key import check_api_key
from frontend_svc.errors import Unauthenticated
from splitserve_runtime.log_limits import RateLimitedLog
from splitserve_runtime.rpc_guard import aio_refusal_handler
from splitserve_runtime.services import FRONTEND

logger = logging.getLogger(__name__)
refusal_log = RateLimitedLog(logger)


def authorization_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The first `authorization` metadata value, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `services` without `authorization: Bearer <api_key>` (UNAUTHENTICATED)
    before their request is even parsed."""

    def __init__(self, api_key: str, services: frozenset[str] | None = None) -> None:
        self.api_key = api_key
        self.services = services or frozenset({FRONTEND.grpc_service})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.lstrip("/").partition("/")[0] not in self.services:
            return handler
        metadata = handler_call_details.invocation_metadata
        try:
            check_api_key(authorization_of(metadata), self.api_key)
        except Unauthenticated as err:
            refusal_log.warning(method, "refused a call to %s: missing or wrong API key", method)
            return aio_refusal_handler(handler, err.grpc_code, str(err))
        return handler


def api_key_interceptors(
    api_key: str, services: Iterable[str] = (FRONTEND.grpc_service,)
) -> tuple[ApiKeyInterceptor, ...]:
    """The interceptors for `--api-key` on `services` (none when the key is empty: the API is
    open)."""
    return (ApiKeyInterceptor(api_key, frozenset(services)),) if api_key else ()
