"""The scheduler's side of KV that moves between engines (vLLM's KV-connector paths in
`Scheduler`), used only when the engine has a KV connector (core_svc/kv_connector/).

Consumer: the waiting pass asks the connector, after the local prefix hit, how many prompt
tokens it loads from a peer; a request that loads gets blocks for its whole prompt and waits in
WAITING_FOR_REMOTE_KVS (`loading`: in neither `waiting` nor `running`) while others step. Loaded,
it goes back to the front of `waiting` with its blocks and num_computed_tokens = prompt - 1 (the
last prompt token is computed again for its logits), and is admitted next without allocating.
A failed load is recomputed: blocks freed, the handoff dropped, back to waiting as if new.

Producer: a finished request the connector hands off keeps its blocks (`sending`) until the
ranks report it pulled (finished_sending) or its lease ends. An aborted load keeps its blocks
(`cancelling`) until the ranks report they stopped writing them.
"""

from __future__ import annotations

import logging
import time

from core_svc.kv_cache.block_pool import KVCacheBlock
from core_svc.kv_connector.base import InvalidKVTransferParams, KVConnectorScheduler
from core_svc.request import Request, RequestStatus
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.sched.scheduler_state import SchedulerState
from splitserve_contracts.output_types import ErrorKind, KVConnectorOutput

logger = logging.getLogger(__name__)


class KVTransfers(SchedulerState):
    """The scheduler's KV-transfer bookkeeping; see the module docstring."""

    def _free_request(self, request: Request) -> None:
        raise NotImplementedError  # Scheduler's

    def _admit_remote(
        self,
        connector: KVConnectorScheduler,
        request: Request,
        hit_blocks: list[KVCacheBlock],
        num_hit_tokens: int,
    ) -> bool | None:
        """Waiting pass, for the waiting request at the queue's head: True when it left the
        queue (parked for its load, or refused for its params), False when it is computed here,
        None when its prompt's blocks do not fit (the pass stops)."""
        if request.kv_load_failed:
            return False
        try:
            num_external, load_async = connector.get_num_new_matched_tokens(request, num_hit_tokens)
        except InvalidKVTransferParams as err:
            self.waiting.pop_request()
            self.num_waiting_tokens -= request.num_tokens
            request.fail(ErrorKind.INVALID_REQUEST, str(err))
            self._free_request(request)
            self.refused.append(request)
            return True
        if not (load_async and num_external > 0):
            return False
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, num_hit_tokens, hit_blocks, True) is None:
            return None
        self.waiting.pop_request()
        self.num_waiting_tokens -= request.num_tokens
        kv.record_prefix_cache_stats(request, num_hit_tokens)
        connector.update_state_after_alloc(request, kv.get_block_ids(request), num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.req_handle] = (request, num_external)
        self.num_external_queries += request.num_tokens - num_hit_tokens
        return True

    def _add_connector_meta(self, connector: KVConnectorScheduler, output: SchedulerOutput) -> None:
        """Free the blocks whose lease ended, then give the step the connector's metadata."""
        for handle in connector.take_expired(time.time()):
            self._release(handle)
        output.kv_connector_metadata = connector.build_connector_meta()

    def _apply_connector_output(
        self, connector: KVConnectorScheduler, output: KVConnectorOutput | None
    ) -> None:
        """What the ranks' connector finished: loads done or failed, sends done."""
        if output is None:
            return
        connector.update_connector_output(output)
        self.kv_loads.num_bytes += output.num_bytes_received
        self.kv_loads.seconds += output.recv_seconds
        for handle in output.finished_recving:
            self._loaded(handle)
        reasons = output.failed_reasons
        for i, handle in enumerate(output.failed_recving):
            self._load_failed(handle, reasons[i] if i < len(reasons) else "")
        for handle in output.finished_sending:
            self._release(handle)

    def _loaded(self, handle: int) -> None:
        entry = self.loading.pop(handle, None)
        if entry is None:
            self._release(handle)  # aborted while loading: its blocks are free to go
            return
        request, num_external = entry
        self.kv_loads.num_loads += 1
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_tokens - 1
        request.kv_transfer_params = None  # used: a preemption later computes it all here
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self.waiting.prepend_request(request)
        self.num_waiting_tokens += request.num_tokens
        self.num_external_hits += num_external

    def _load_failed(self, handle: int, reason: str) -> None:
        entry = self.loading.pop(handle, None)
        if entry is None:
            self._release(handle)
            return
        request = entry[0]
        logger.warning(
            "request %s: loading its KV failed (%s); computing its prompt here",
            request.request_id[:64],
            reason or "no reason given",
        )
        request.kv_load_failed = True
        self.kv_loads.num_failed += 1  # not an aborted one's cancel: it is computed here
        self._recompute(request)

    def _recompute(self, request: Request) -> None:
        """A parked request goes back to the queue's front as if new: no blocks, no handoff."""
        self.kv_cache_manager.free(request)
        request.kv_transfer_params = None
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.prepend_request(request)
        self.num_waiting_tokens += request.num_tokens

    def _release(self, handle: int) -> None:
        """Free the blocks kept for a transfer that ended (unknown handles: no-ops)."""
        request = self.sending.pop(handle, None) or self.cancelling.pop(handle, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    def _keeps_blocks(self, connector: KVConnectorScheduler, request: Request) -> bool:
        """A finished request: ask the connector whether its blocks stay (a handoff to serve,
        a load to cancel first); its final output carries what the connector returns."""
        delay_free, params = connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request)
        )
        request.kv_transfer_params = params
        was_loading = self.loading.pop(request.req_handle, None) is not None
        if delay_free:
            (self.cancelling if was_loading else self.sending)[request.req_handle] = request
        return delay_free

    def _drop_kv_transfers(self, connector: KVConnectorScheduler) -> None:
        """The ranks lost their state (a rank restarted): every transfer ends with them. Loads
        and loaded prompts are computed again, kept blocks are freed, and the connector forgets
        what it sent."""
        lost = list(self.loading)
        for request, _ in list(self.loading.values()):
            self._recompute(request)
        self.loading.clear()
        for request in self.waiting:
            if request.num_computed_tokens:  # loaded, not admitted yet: its KV is gone
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
        lost += self.cancelling
        for handle in [*self.sending, *self.cancelling]:
            self._release(handle)
        connector.build_connector_meta()  # what was still to be sent is lost with the ranks
        expired = connector.take_expired(float("inf"))
        connector.update_connector_output(
            KVConnectorOutput(finished_sending=expired, failed_recving=lost)
        )
        connector.build_connector_meta()  # the new ranks serve none of the released leases
