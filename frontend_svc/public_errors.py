"""What a client may read of a failure. Errors about the client's own request keep their message
(it says what to change). Failures on the server's side (engine unavailable, internal errors)
carry internal detail: worker addresses, file paths, exception text. The client gets a generic
message with an error id; the log has the detail under the same id."""

from __future__ import annotations

import logging

import grpc

from frontend_svc.errors import FrontendError
from splitserve_runtime.rpc_guard import new_error_id

logger = logging.getLogger(__name__)
GENERIC_MESSAGES = {
    grpc.StatusCode.UNAVAILABLE: "the engine cannot serve this request right now; retry shortly",
    grpc.StatusCode.INTERNAL: "internal error",
    grpc.StatusCode.UNKNOWN: "internal error",
    grpc.StatusCode.DATA_LOSS: "internal error",
}


def client_message(err: FrontendError) -> str:
    """The message to send the client for `err` (server-side faults: logged, replaced)."""
    generic = GENERIC_MESSAGES.get(err.grpc_code)
    if generic is None:
        return str(err)
    error_id = new_error_id()
    logger.error("error %s (%s): %s", error_id, err.grpc_code.name, err)
    return f"{generic} (error id {error_id})"
