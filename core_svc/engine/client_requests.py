"""The engine core's requests as its clients know them: each client's live requests by
client_handle, and the outputs owed to clients between steps (refusals, aborts)."""

from __future__ import annotations

from collections.abc import Iterable

from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import Request
from splitserve_contracts.output_types import ErrorKind, FinishReason


class ClientRequests:
    """client_id -> client_handle -> live request, and the outputs the next step returns
    besides its own."""

    def __init__(self) -> None:
        self.live: dict[int, dict[int, Request]] = {}
        self.pending: dict[int, EngineCoreOutputs] = {}

    def is_handle_in_use(self, request: Request) -> bool:
        return request.client_handle in self.live.get(request.client_id, {})

    def add(self, request: Request) -> None:
        self.live.setdefault(request.client_id, {})[request.client_handle] = request

    def discard(self, request: Request) -> None:
        self.live.get(request.client_id, {}).pop(request.client_handle, None)

    def refuse(self, request: Request, kind: ErrorKind, error: str) -> None:
        """Fail the request; the next step's outputs tell its client (finished with ERROR)."""
        request.fail(kind, error)
        outputs = self.pending.setdefault(request.client_id, EngineCoreOutputs())
        outputs.details.append(
            EngineCoreOutput(
                request_handle=request.client_handle,
                finish_reason=FinishReason.ERROR,
                error_message=error,
                error_kind=kind,
            )
        )

    def abort(self, client_id: int, client_handles: Iterable[int]) -> list[Request]:
        """Forget the client's live requests of `client_handles` (unknown ones are no-ops) and
        return them; the client gets the next step's outputs even if nothing else is owed."""
        live = self.live.get(client_id)
        if not live:
            return []
        requests = [r for h in client_handles if (r := live.pop(h, None)) is not None]
        if requests:
            self.pending.setdefault(client_id, EngineCoreOutputs())
        if not live:
            del self.live[client_id]
        return requests

    def drop_client(self, client_id: int) -> list[Request]:
        """Forget the client (its stream closed); returns its live requests."""
        live = self.live.pop(client_id, None)
        self.pending.pop(client_id, None)
        return list(live.values()) if live else []

    def take_pending(self) -> dict[int, EngineCoreOutputs]:
        outputs, self.pending = self.pending, {}
        return outputs

    def forget_finished(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for client_id, engine_outputs in outputs.items():
            live = self.live.get(client_id)
            if live is None:
                continue
            for detail in engine_outputs.details:
                if detail.finish_reason is not None:
                    live.pop(detail.request_handle, None)
            if not live:
                del self.live[client_id]
