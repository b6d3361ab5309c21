"""What a client may read of a failure. Errors keep their message (it says what to change, or
that the engine is unavailable, shutting down, full). What only the server should know (worker
addresses, file paths, exception text: an error's `detail`, or any unexpected internal error)
goes to the log under an error id, and the client gets the id."""

from __future__ import annotations

import logging

import grpc

from frontend_svc.errors import FrontendError
from splitserve_runtime.log_limits import RateLimitedLog
from splitserve_runtime.rpc_guard import new_error_id

logger = logging.getLogger(__name__)
unexpected_log = RateLimitedLog(logger)
MAX_MESSAGE_CHARS = 1024
"""Messages are cut to this (a gRPC status rides in trailing metadata, which clients refuse past
16 KiB; an HTTP error need not repeat a client's megabyte either)."""
GENERIC_MESSAGES = {
    grpc.StatusCode.INTERNAL: "internal error",
    grpc.StatusCode.UNKNOWN: "internal error",
    grpc.StatusCode.DATA_LOSS: "internal error",
}


def client_message(err: FrontendError) -> str:
    """The message to send the client for `err` (server-side detail: logged, not sent)."""
    generic = GENERIC_MESSAGES.get(err.grpc_code)
    detail = getattr(err, "detail", "")
    if generic is None and not detail:
        return str(err)
    error_id = new_error_id()
    logger.error("error %s (%s): %s %s", error_id, err.grpc_code.name, err, detail)
    return f"{generic or str(err)} (error id {error_id})"


def unexpected_error_message(where: str) -> str:
    """For an unexpected exception being handled in `where` (a route, a method): log it with
    its traceback under a new error id (at most one line per `where` per interval: a client
    that finds a way to trigger it cannot flood the log) and return the client's message."""
    error_id = new_error_id()
    unexpected_log.exception(where, "error %s in %s", error_id, where)
    return f"internal error (error id {error_id})"


def bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
