"""Server interceptors that guard every RPC before the servicer sees it (grpc.aio and sync).

- Malformed protobuf: grpc would answer UNKNOWN with a Python class name (grpc.aio) or INTERNAL
  (sync) and log a traceback per message. Here the request deserializer never raises: a message
  that does not parse ends the call with INVALID_ARGUMENT naming the expected message type, and
  one warning per method per interval is logged.
- Admission: per gRPC service, a check of the caller (its certificate's role, an API key...)
  that may refuse the call with a status before the servicer runs.
- Error shield (public ports): an unexpected exception in a servicer reaches the client as
  INTERNAL with an error id, never as its Python text; the log has the details under that id.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_runtime.log_limits import RateLimitedLog
from splitserve_runtime.services import INTERNAL_SECRET_METADATA_KEY
from splitserve_runtime.tls import peer_names

logger = logging.getLogger(__name__)
malformed_log = RateLimitedLog(logger)
refusal_log = RateLimitedLog(logger)

Refusal = tuple[grpc.StatusCode, str]
Admission = Callable[[Any], Refusal | None]
"""Looks at the ServicerContext (sync or aio); returns a refusal, or None to let the call in."""
Behavior = Callable[..., Any]
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    """What the guarded deserializer returns for bytes that do not parse."""

    type_name: str


@dataclass(frozen=True)
class GuardPolicy:
    """`admissions` by full gRPC service name (services not named are open); `shield_errors`
    hides unexpected servicer errors behind an error id (grpc.aio only)."""

    admissions: Mapping[str, Admission] = field(default_factory=dict)
    shield_errors: bool = False


def role_admission(allowed_roles: frozenset[str]) -> Admission:
    """Admit callers whose verified certificate names one of `allowed_roles`."""

    def admit(context: Any) -> Refusal | None:
        names = peer_names(context)
        if names & allowed_roles:
            return None
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"this service accepts calls only from {', '.join(sorted(allowed_roles))}; the "
            f"caller's certificate names {', '.join(sorted(names)) or 'no identity'}",
        )

    return admit


def secret_admission(secret: str) -> Admission:
    """Admit callers whose metadata carries `secret` under INTERNAL_SECRET_METADATA_KEY
    (compared in constant time). The refusal never repeats what was presented or expected."""
    expected = secret.encode()

    def admit(context: Any) -> Refusal | None:
        presented = b""
        for key, value in context.invocation_metadata() or ():
            if key == INTERNAL_SECRET_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(presented, expected):
            return None
        refusal_log.warning(
            "secret", "refused a call from %s: missing or wrong internal secret", context.peer()
        )
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            "this internal service admits only calls carrying the deployment's internal secret "
            f"(metadata {INTERNAL_SECRET_METADATA_KEY}; --internal-secret on every service)",
        )

    return admit


def all_of(*admissions: Admission) -> Admission:
    """Admit a caller that every one of `admissions` admits (the first refusal answers)."""

    def admit(context: Any) -> Refusal | None:
        for check in admissions:
            refusal = check(context)
            if refusal is not None:
                return refusal
        return None

    return admit


def new_error_id() -> str:
    """A short id that ties a client-visible error to its server-side log line."""
    return uuid.uuid4().hex[:12]


def _type_name(deserializer: Behavior) -> str:
    message_class = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "request message"))


def guarded_deserializer(deserializer: Behavior | None) -> Behavior | None:
    """`deserializer` that returns MalformedMessage instead of raising."""
    if deserializer is None:
        return None
    type_name = _type_name(deserializer)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 (any parse failure is the caller's malformed bytes)
            return MalformedMessage(type_name)

    return parse


def _malformed_refusal(context: Any, method: str, bad: MalformedMessage) -> Refusal:
    malformed_log.warning(
        method, "malformed %s on %s from %s: refused", bad.type_name, method, context.peer()
    )
    return (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid {bad.type_name} (malformed protobuf)",
    )


def _service_of(method: str) -> str:
    return method.lstrip("/").partition("/")[0]


def _rebuild(handler: Any, wrap: Callable[[str, Behavior], Behavior]) -> Any:
    for kind in KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(
                request_deserializer=guarded_deserializer(handler.request_deserializer),
                **{kind: wrap(kind, behavior)},
            )
    return handler


class AioRpcGuard(grpc.aio.ServerInterceptor):
    """GuardPolicy for grpc.aio servers."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        admit = self.policy.admissions.get(_service_of(method))
        shield = self.policy.shield_errors
        return _rebuild(handler, lambda kind, b: _wrap_aio(kind, b, method, admit, shield))


async def _aio_requests(requests: AsyncIterator[Any], context: Any, method: str) -> Any:
    async for request in requests:
        if isinstance(request, MalformedMessage):
            await context.abort(*_malformed_refusal(context, method, request))
        yield request


async def _aio_prepare(
    kind: str, request: Any, context: Any, method: str, admit: Admission | None
) -> Any:
    refusal = admit(context) if admit is not None else None
    if refusal is not None:
        await context.abort(*refusal)
    if kind.startswith("stream"):
        return _aio_requests(request, context, method)
    if isinstance(request, MalformedMessage):
        await context.abort(*_malformed_refusal(context, method, request))
    return request


async def _answer_internal(context: Any, method: str) -> None:
    """Inside `except Exception`: log the error under an id, answer INTERNAL with the id."""
    error_id = new_error_id()
    logger.exception("error %s in %s", error_id, method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (error id {error_id})")


def _wrap_aio(
    kind: str, behavior: Behavior, method: str, admit: Admission | None, shield: bool
) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            request = await _aio_prepare(kind, request, context, method, admit)
            try:
                async for item in behavior(request, context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception:
                if not shield:
                    raise
                await _answer_internal(context, method)

        return stream

    async def call(request: Any, context: Any) -> Any:
        request = await _aio_prepare(kind, request, context, method, admit)
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:
            if not shield:
                raise
            await _answer_internal(context, method)

    return call


def aio_refusal_handler(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of `handler`'s kind that refuses every call with `code` and `message`."""

    async def refuse(request: Any, context: Any) -> None:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # never reached: an async generator, as streaming wrappers expect

    return _rebuild(handler, lambda kind, _: refuse_stream if kind.endswith("stream") else refuse)


class SyncRpcGuard(grpc.ServerInterceptor):
    """GuardPolicy for synchronous servers (no error shield: only internal ports are sync)."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        admit = self.policy.admissions.get(_service_of(method))
        return _rebuild(handler, lambda kind, b: _wrap_sync(kind, b, method, admit))


def _sync_requests(requests: Iterator[Any], context: Any, method: str) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, MalformedMessage):
            context.abort(*_malformed_refusal(context, method, request))
        yield request


def _wrap_sync(kind: str, behavior: Behavior, method: str, admit: Admission | None) -> Behavior:
    def prepare(request: Any, context: Any) -> Any:
        refusal = admit(context) if admit is not None else None
        if refusal is not None:
            context.abort(*refusal)
        if kind.startswith("stream"):
            return _sync_requests(request, context, method)
        if isinstance(request, MalformedMessage):
            context.abort(*_malformed_refusal(context, method, request))
        return request

    if kind.endswith("stream"):

        def stream(request: Any, context: Any) -> Iterator[Any]:
            yield from behavior(prepare(request, context), context)

        return stream

    def call(request: Any, context: Any) -> Any:
        return behavior(prepare(request, context), context)

    return call
