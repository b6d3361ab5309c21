"""What a client may read of a failure. Errors keep their message (it says what to change, or
that the engine is unavailable, shutting down, full). What only the server should know (worker
addresses, file paths, exception text: an error's `detail`, or any unexpected internal error)
goes to the log under an error id, and the client gets the id."""

from __future__ import annotations

import logging

import grpc

from frontend_svc.errors import FrontendError
from splitserve_runtime.rpc_guard import new_error_id

logger = logging.getLogger(__name__)
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
