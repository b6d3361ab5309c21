"""One step with a KV connector, in vLLM's order (KVConnectorModelRunnerMixin): bind the
metadata and start loads before the step, its saves after, and the finished transfers in the
step's output; a step with no scheduled tokens runs no forward and answers the same way. A rank
that answers no step (not the output rank: TP > 1, PP > 1) answers one with only its transfers'
report when it has one; the engine core counts a transfer done once every rank reported it."""

from __future__ import annotations

from collections.abc import Callable

from splitserve_contracts.output_types import ModelRunnerOutput, StepStatus
from worker_svc.kv_connector.base import KVConnectorWorker
from worker_svc.scheduler_output import SchedulerOutput


def run_step_with_connector(
    connector: KVConnectorWorker,
    step: SchedulerOutput,
    run: Callable[[], ModelRunnerOutput | None],
) -> ModelRunnerOutput | None:
    """`run` the step between the connector's hooks. The model has no per-layer call-out, so
    the per-layer hooks run for every layer just before the step (wait_for_layer_load) and
    after it (save_kv_layer): a connector that streams layer by layer during the forward needs
    that call-out in the decoder's layer loop (worker_svc/models/decoder.py)."""
    connector.bind_connector_metadata(step.kv_connector_metadata)
    connector.start_load_kv()
    num_layers = connector.layout.num_layers
    for layer in range(num_layers):
        connector.wait_for_layer_load(layer)
    try:
        output = run()
        for layer in range(num_layers):
            connector.save_kv_layer(layer)
        connector.wait_for_save()
        finished = connector.get_finished(step.finished_req_handles.tolist())
        if output is not None:
            output.kv_connector_output = finished
        elif finished is not None:  # a rank that answers no step reports its transfers alone
            output = ModelRunnerOutput(
                step_id=step.step_id,
                status=StepStatus.OK,
                rank=connector.layout.rank,
                kv_connector_output=finished,
            )
        return output
    finally:
        connector.clear_connector_metadata()
