"""Why the frontend refuses or ends a request, and what each reason is on each public API.

Every error a client can get is one of these classes; the class says its gRPC status, its HTTP
status and the OpenAI error `type`, so the gRPC servicer and the HTTP server answer the same
failure the same way. The message always says what the caller can do about it.
"""

from __future__ import annotations

import grpc

from splitserve_contracts.output_types import ErrorKind


class FrontendError(Exception):
    """Base of the errors a client sees."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    error_type = "internal_server_error"
    reason = "INTERNAL"
    """google.rpc.ErrorInfo reason: a constant clients can switch on."""
    param: str | None = None
    """The request field at fault, when one is (OpenAI's error `param`; a gRPC BadRequest
    field violation)."""


class InvalidRequest(FrontendError, ValueError):
    """A request the frontend refuses; the message tells the caller what to change and `param`
    names the offending field of the request when one is to blame."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"
    reason = "INVALID_REQUEST"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BodyTooLarge(InvalidRequest):
    """An HTTP request body over --max-receive-message-bytes: 413 Content Too Large (over gRPC,
    grpc itself refuses such a message with RESOURCE_EXHAUSTED)."""

    http_status = 413

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the body is over {max_bytes} bytes (--max-receive-message-bytes)")


class ModelNotFound(FrontendError):
    """The request names a model this server does not serve."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    error_type = "not_found_error"
    reason = "MODEL_NOT_FOUND"


class NotEnabled(FrontendError):
    """The call needs what this server was started without (a flag, an environment switch);
    HTTP 404, as vLLM, whose route then does not exist."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 404
    error_type = "not_found_error"
    reason = "NOT_ENABLED"


class Unauthenticated(FrontendError):
    """A missing or wrong API key."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    error_type = "authentication_error"
    reason = "UNAUTHENTICATED"


class Overloaded(FrontendError):
    """Admission refused: the engine's queue is full. Retry after `retry_after_s` seconds."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_error"
    reason = "OVERLOADED"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(FrontendError):
    """The engine core cannot be reached or failed; in-flight requests end with this.
    `detail` is what the server knows beyond the message (addresses, the engine's own error
    text): it goes to the log, under an error id the client gets, never to the client."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable_error"
    reason = "ENGINE_UNAVAILABLE"


def engine_error(request_id: str, kind: int, message: str) -> FrontendError:
    """The client-facing error for a request the engine ended with FINISH_REASON_ERROR, the
    same on both APIs: its own bad data -> InvalidRequest (400) with the engine's reason, which
    is about the request (the same message over gRPC and HTTP); a full queue -> Overloaded
    (429, RetryInfo / Retry-After); anything else -> EngineUnavailable (503), the engine's
    text only in the log, under the error id the client gets."""
    if kind == ErrorKind.INVALID_REQUEST:
        return InvalidRequest(f"refused by the engine: {message}")
    if kind == ErrorKind.OVERLOADED:
        return Overloaded(message)
    return EngineUnavailable(
        f"the engine failed while serving request {request_id}; retry it",
        detail=message or "unknown error",
    )


def check_model(
    requested: str | None, served_model_name: str, aliases: tuple[str, ...] = ()
) -> None:
    """Both APIs: a request naming a model other than the served one (or one of its
    --served-model-name aliases) gets ModelNotFound (404 / NOT_FOUND); no name means the served
    model."""
    if requested and requested != served_model_name and requested not in aliases:
        raise ModelNotFound(
            f"the model `{shorten(requested)}` does not exist; this server serves "
            f"`{served_model_name}`"
        )


MAX_ECHO_CHARS = 64
"""Most characters of a client's own value a message repeats back to it."""


def shorten(value: str) -> str:
    """`value` as a message may quote it: a client's 1 MB field is not echoed back (in gRPC it
    would not even fit the status metadata, and the client would get RESOURCE_EXHAUSTED)."""
    if len(value) <= MAX_ECHO_CHARS:
        return value
    return f"{value[:MAX_ECHO_CHARS]}... ({len(value)} characters)"
