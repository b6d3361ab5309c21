"""Builders for the KV-connector tests: GrpcConnector engines on a FakeExecutor whose ranks
record the connector's metadata and report what the test tells them."""

from __future__ import annotations

import json
import time
from typing import Any

from core_svc.engine.engine_core import EngineCore
from core_svc.kv_connector.grpc_connector import GrpcConnectorScheduler
from core_svc.kv_connector.handoff import make_handoff
from core_svc.request import Request
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb2
from splitserve_contracts.output_types import KVConnectorOutput, ModelRunnerOutput
from tests.unit.core.fake_executor import FakeExecutor, make_engine, make_request

BLOCK_SIZE = 4
OWN_ID = "e" * 32
PEER_ID = "p" * 32
TRANSFER_ID = "ab" * 16
ADDRESS = "10.0.0.7:7001"
PROMPT = list(range(10, 20))
"""10 tokens: 3 blocks of 4, the last one half full."""


class KvExecutor(FakeExecutor):
    """FakeExecutor with a connector on its ranks: `metas` holds every step's metadata, and the
    step after `report` is set answers with it (once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metas: list[kv_pb2.GrpcConnectorMetadata] = []
        self.report: KVConnectorOutput | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        meta = kv_pb2.GrpcConnectorMetadata.FromString(scheduler_output.kv_connector_metadata)
        self.metas.append(meta)
        output = super().execute_model(scheduler_output)
        output.kv_connector_output, self.report = self.report, None
        return output

    def loads(self) -> list[kv_pb2.KvLoad]:
        return [load for meta in self.metas for load in meta.loads]

    def pull(self, load: kv_pb2.KvLoad, prompt: list[int]) -> None:
        """Write what pulling `load` brings: the prompt's KV in its local blocks."""
        bs = self.block_size
        first = -(-len(prompt) // bs) - len(load.local_block_ids)
        for pos in range(first * bs, len(prompt)):
            self.kv[load.local_block_ids[pos // bs - first]][pos % bs] = (pos, prompt[pos])


def kv_engine(
    role: str, extra: dict[str, Any] | None = None, **options: Any
) -> tuple[EngineCore, KvExecutor, GrpcConnectorScheduler]:
    """An engine of `role` with a GrpcConnector (blocks of BLOCK_SIZE tokens, id OWN_ID)."""
    transfer = KVTransferOptions("GrpcConnector", role, json.dumps(extra or {}), OWN_ID)
    connector = GrpcConnectorScheduler(transfer, OWN_ID, BLOCK_SIZE, [ADDRESS])
    engine, executor = make_engine(
        block_size=BLOCK_SIZE, kv_connector=connector, executor_class=KvExecutor, **options
    )
    assert isinstance(executor, KvExecutor)
    return engine, executor, connector


def consumer_request(handle: int = 1, prompt: list[int] = PROMPT, **params: object) -> Request:
    """A decode leg: `prompt` with a valid handoff (with `params` changed)."""
    request = make_request(handle, prompt, max_tokens=3, ignore_eos=True)
    request.kv_transfer_params = handoff(len(prompt), **params)
    return request


def handoff(num_tokens: int, **changes: Any) -> dict[str, Any]:
    """A producer's valid handoff for a prompt of `num_tokens`, with `changes`."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    params = make_handoff(
        PEER_ID,
        list(range(50, 50 + num_blocks)),
        [ADDRESS],
        TRANSFER_ID,
        num_tokens,
        time.time() + 30,
    )
    return params | changes
