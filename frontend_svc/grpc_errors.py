"""A FrontendError as a gRPC status with structured details (google.rpc.Status): ErrorInfo with
a stable reason, BadRequest field violations naming the field to fix, RetryInfo when the client
should come back later. Clients in any language read them with their gRPC status library."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from frontend_svc.errors import FrontendError, Overloaded
from frontend_svc.public_errors import bounded, client_message

DOMAIN = "splitserve.dev"


def to_status(err: FrontendError) -> grpc.Status:
    """The rich status for `err`."""
    details = [error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN)]
    if err.param:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.param, description=bounded(str(err))
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(err, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(err.retry_after_s * 1000))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    code = getattr(code_pb2, err.grpc_code.name)
    message = bounded(client_message(err))
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=packed))


async def abort(context: grpc.aio.ServicerContext, err: FrontendError) -> None:
    """End the call with `err` (raises, as context.abort does)."""
    await context.abort_with_status(to_status(err))
