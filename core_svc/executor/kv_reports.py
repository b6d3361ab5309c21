"""Every rank's KV-transfer report merged into one (vLLM's KVOutputAggregator): with tensor or
pipeline parallelism each rank moves its own part of a request's KV, so a load or a send is done
only once every rank reported it. The output rank's report comes with its step's output; the
others' come alone, read by the executor's watcher threads (worker_svc/kv_connector/step_hooks)."""

from __future__ import annotations

import threading
from collections import Counter

from splitserve_contracts.output_types import KVConnectorOutput


class KvReports:
    """Merges reports of `num_ranks` ranks; `add` from any thread, `merge` from the busy loop."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._lock = threading.Lock()
        self._others: list[KVConnectorOutput] = []
        self._recv: Counter[int] = Counter()
        self._sent: Counter[int] = Counter()
        self._failures: dict[int, str] = {}
        """The first failure reported for a load that not every rank reported yet."""

    def add(self, report: KVConnectorOutput) -> None:
        """A report of a rank that answers no step."""
        with self._lock:
            self._others.append(report)

    def merge(self, report: KVConnectorOutput | None) -> KVConnectorOutput | None:
        """The output rank's `report` with the others' so far: the transfers every rank has now
        reported (failed when any rank failed it), the bytes and seconds of all; None: none."""
        if report is None and not self._others:
            return None  # every step of an engine without a connector: no lock taken (a
            # report a watcher adds meanwhile waits for the next step)
        with self._lock:
            reports, self._others = self._others, []
        if report is not None:
            reports.append(report)
        if not reports:
            return None
        merged = KVConnectorOutput()
        for part in reports:
            self._count(part, merged)
        is_empty = not (merged.finished_recving or merged.failed_recving or merged.finished_sending)
        return None if is_empty and not merged.num_bytes_received else merged

    def _count(self, part: KVConnectorOutput, merged: KVConnectorOutput) -> None:
        merged.num_bytes_received += part.num_bytes_received
        merged.recv_seconds += part.recv_seconds
        reasons = part.failed_reasons
        for i, handle in enumerate(part.failed_recving):
            self._failures.setdefault(handle, reasons[i] if i < len(reasons) else "")
        for handle in (*part.finished_recving, *part.failed_recving):
            self._recv[handle] += 1
            if self._recv[handle] == self.num_ranks:
                del self._recv[handle]
                failure = self._failures.pop(handle, None)
                if failure is None:
                    merged.finished_recving.append(handle)
                else:
                    merged.failed_recving.append(handle)
                    merged.failed_reasons.append(failure)
        for handle in part.finished_sending:
            self._sent[handle] += 1
            if self._sent[handle] == self.num_ranks:
                del self._sent[handle]
                merged.finished_sending.append(handle)
