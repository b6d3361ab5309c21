"""The public API key: one check for the gRPC and the HTTP API (vLLM's --api-key)."""

from __future__ import annotations

import hmac

from frontend_svc.errors import Unauthenticated

BEARER = "bearer "


def check_api_key(authorization: str | None, expected: str) -> None:
    """Raise Unauthenticated unless `authorization` is "Bearer <expected>" (compared in constant
    time). An empty `expected` means the server has no key: everything passes."""
    if not expected:
        return
    presented = ""
    if authorization and authorization[: len(BEARER)].lower() == BEARER:
        presented = authorization[len(BEARER) :].strip()
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated(
            "missing or wrong API key: send the header `authorization: Bearer <key>`"
        )
