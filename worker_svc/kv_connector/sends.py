"""The producer's leased transfers: registered from the step's metadata, claimed by one PullKv,
done when that stream ends (or is cancelled), dropped when the engine core releases them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from worker_svc.kv_connector.kv_convert import KvSend
from worker_svc.kv_connector.reports import Reports

REMEMBERED_RELEASES = 4096
"""Released transfer ids kept to tell "lease ended" from "unknown"."""


class PullRefused(Exception):  # noqa: N818 (a refusal, not an error of this rank)
    """A PullKv this rank will not serve: the status code and what to tell the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Transfer:
    """One leased transfer; `released` is set when the lease ended while it was pulled."""

    send: KvSend
    is_pulling: bool = False
    released: threading.Event = field(default_factory=threading.Event)


class SendRegistry:
    """Thread-safe: the step thread registers and releases, PullKv threads claim and finish."""

    def __init__(self, reports: Reports) -> None:
        self._reports = reports
        self._cond = threading.Condition()
        self._transfers: dict[str, Transfer] = {}
        self._released: OrderedDict[str, None] = OrderedDict()

    def register(self, sends: Iterable[KvSend]) -> None:
        with self._cond:
            for send in sends:
                self._transfers[send.transfer_id] = Transfer(send)
            self._cond.notify_all()

    def release(self, transfer_ids: Iterable[str]) -> None:
        """The engine core freed these transfers' blocks: stop serving them (a pull in progress
        stops before its next chunk); no finished_sending follows."""
        with self._cond:
            for transfer_id in transfer_ids:
                transfer = self._transfers.pop(transfer_id, None)
                if transfer is not None:
                    transfer.released.set()
                self._released[transfer_id] = None
                while len(self._released) > REMEMBERED_RELEASES:
                    self._released.popitem(last=False)
            self._cond.notify_all()

    def claim(self, transfer_id: str, block_ids: Sequence[int], wait_seconds: float) -> Transfer:
        """The transfer for one pull of `block_ids` (a suffix of its leased blocks), waiting up
        to `wait_seconds` for a registration still on its way in the next step's metadata;
        PullRefused says why not."""
        deadline = time.monotonic() + wait_seconds
        with self._cond:
            while (transfer := self._transfers.get(transfer_id)) is None:
                if transfer_id in self._released:
                    raise PullRefused(
                        grpc.StatusCode.NOT_FOUND, f"transfer {transfer_id}: its lease ended"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PullRefused(
                        grpc.StatusCode.NOT_FOUND, f"transfer {transfer_id} is unknown here"
                    )
                self._cond.wait(left)
            leased = transfer.send.block_ids
            if not block_ids or tuple(block_ids) != leased[len(leased) - len(block_ids) :]:
                raise PullRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"transfer {transfer_id}: block_ids must be a non-empty suffix of the "
                    f"{len(leased)} leased blocks",
                )
            if transfer.is_pulling:
                raise PullRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"transfer {transfer_id} is being pulled already",
                )
            transfer.is_pulling = True
            return transfer

    def done(self, transfer: Transfer) -> None:
        """The pull ended (streamed, failed or cancelled): the blocks are no longer served, and
        the next output reports finished_sending (unless the lease ended first). Idempotent."""
        with self._cond:
            transfer_id = transfer.send.transfer_id
            if self._transfers.get(transfer_id) is not transfer:
                return
            del self._transfers[transfer_id]
        self._reports.sent(transfer.send.req_handle)

    def close(self) -> None:
        """Stop every pull in progress (the rank drops its cache)."""
        with self._cond:
            for transfer in self._transfers.values():
                transfer.released.set()
            self._transfers.clear()
            self._cond.notify_all()
