"""What a rank's connector finished, gathered from its transfer threads until the next step's
output takes it (vLLM's get_finished)."""

from __future__ import annotations

import threading

from splitserve_contracts.output_types import KVConnectorOutput


class Reports:
    """Thread-safe: transfer threads add, the step thread takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = KVConnectorOutput()
        self._is_empty = True

    def sent(self, req_handle: int) -> None:
        with self._lock:
            self._pending.finished_sending.append(req_handle)
            self._is_empty = False

    def received(self, req_handle: int, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._pending.finished_recving.append(req_handle)
            self._pending.num_bytes_received += num_bytes
            self._pending.recv_seconds += seconds
            self._is_empty = False

    def failed(self, req_handle: int, reason: str) -> None:
        with self._lock:
            self._pending.failed_recving.append(req_handle)
            self._pending.failed_reasons.append(reason)
            self._is_empty = False

    def take(self) -> KVConnectorOutput | None:
        """Everything reported since the previous take; None when nothing was."""
        with self._lock:
            if self._is_empty:
                return None
            taken, self._pending, self._is_empty = self._pending, KVConnectorOutput(), True
            return taken
