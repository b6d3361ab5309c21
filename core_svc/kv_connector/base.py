"""KVConnectorScheduler: the engine core's side of a KV connector (vLLM's KVConnectorBase_V1 in
its scheduler role), the seam through which a connector moves a request's KV between engines.

vLLM's KVConnectorBase_V1 is one class with a scheduler half and a worker half, split by role
at construction; here the halves live in different processes: this one in the engine core (no
torch), worker_svc/kv_connector/base.py's KVConnectorWorker in every rank. They speak through
the step: `build_connector_meta` rides in SchedulerOutput.kv_connector_metadata, and each rank's
KVConnectorOutput comes back in ModelRunnerOutput.kv_connector_output.

A connector is built complete (core_svc/kv_connector/factory.py) and the scheduler calls it only
on its loop thread. An engine without a connector has no connector object at all.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from core_svc.request import Request
from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.output_types import KVConnectorOutput


class InvalidKVTransferParams(ValueError):
    """A request's kv_transfer_params the connector cannot use; the message starts with
    "kv_transfer_params.<key>: " (the request ends with ERROR / INVALID_REQUEST)."""


class KVConnectorScheduler(ABC):
    """The scheduler's view of a KV connector; see the module docstring."""

    poll_interval: float = 0.01
    """Seconds between the empty steps the engine sends while `has_pending` and nothing else
    runs, so the ranks can report finished transfers (see `poll_seconds`)."""

    def __init__(
        self,
        options: KVTransferOptions,
        engine_id: str,
        block_size: int,
        worker_addresses: list[str],
    ) -> None:
        self.options = options
        self.engine_id = engine_id
        """This engine's id among the engines that exchange KV (kv_transfer.kv_engine_id)."""
        self.block_size = block_size
        self.worker_addresses = worker_addresses
        """Where the peers reach this engine's ranks ("host:port"), one per rank."""
        extra = options.kv_connector_extra_config
        self.extra_config: dict[str, Any] = json.loads(extra) if extra else {}
        """kv_connector_extra_config, the connector's own settings."""
        self._configure()

    @abstractmethod
    def _configure(self) -> None:
        """Read the connector's own settings (`extra_config`) and set up its state;
        ValueError refuses them."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """vLLM's get_num_new_matched_tokens: the prompt tokens beyond the local prefix hit
        (`num_computed_tokens`, full blocks) whose KV the connector can provide, and whether it
        loads them asynchronously (the request waits in WAITING_FOR_REMOTE_KVS meanwhile).
        (0, False): the engine computes the prompt itself. Raises InvalidKVTransferParams for
        params it cannot use."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """vLLM's update_state_after_alloc: the request's blocks are allocated for its whole
        prompt (`block_ids`, all of them); the connector records the load of the last
        `num_external_tokens` prompt tokens into them."""

    @abstractmethod
    def build_connector_meta(self) -> bytes:
        """vLLM's build_connector_meta: what the ranks need for the next step (serialized, the
        connector's own message); b"" when there is nothing to say. Called once per step: what
        it returns is considered sent."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished: the request finished (any status) holding `block_ids`.
        Returns whether the core must keep its blocks allocated (until a rank reports the
        request in finished_sending / finished_recving / failed_recving, or `take_expired`
        names it), and the kv_transfer_params its final output carries (None: none)."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """vLLM's update_connector_output: what the ranks finished since their last output."""

    @abstractmethod
    def take_expired(self, now: float) -> list[int]:
        """The req handles whose blocks were kept for a peer and whose lease ended at `now`
        (unix time); the core frees their blocks (vLLM's NIXL abort timeout)."""

    def poll_seconds(self) -> float:
        """The wait before the next empty step while only transfers are pending:
        `poll_interval`; a connector may wait longer when nothing a request waits on is in
        flight (blocks leased to a peer)."""
        return self.poll_interval

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether transfers are in progress or metadata waits to be sent: the engine keeps
        stepping (an empty step every `poll_interval` when nothing else runs)."""
