"""GrpcExecutor: broadcast each SchedulerOutput to every worker rank over its Execute stream and
take the ModelRunnerOutput from the output rank.

The step's critical path stays on the engine's busy-loop thread and in gRPC's C core: the step
is serialised once, the same bytes go to every rank's stream, and the busy-loop thread blocks
reading the output rank's reply. Nothing on that path waits for the asyncio loop that serves the
frontends (which may be busy sending the previous step's outputs). One watcher thread per other
rank reads its stream: an error reply, a closed stream or a broken connection on ANY rank fails
the executor at once (the pending step raises ExecutorError and `on_failure` reports it, with the
executor) instead of waiting for a fixed timeout; a watchdog cancels a step that outlives its
timeout (core_svc.executor.step_timeout). A failed executor stays failed: after the ranks are brought up again (core_svc/recovery.py) the
engine runs on a new one, with new streams and the new owner epoch.

Under --async-scheduling the engine sends step N+1 (`submit_model`) before it reads step N's
output (`collect_model`): the streams carry both, the ranks run them in order, and the timeout
clock of a step starts when the step before it answered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from core_svc import convert
from core_svc.executor.abstract import ExecutorError, FaultCause
from core_svc.executor.kv_reports import KvReports
from core_svc.executor.step_timeout import StepTimeout
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.common.v1 import types_pb2 as common_pb2
from splitserve_contracts.output_convert import k_v_connector_output_from_proto
from splitserve_contracts.output_types import ModelRunnerOutput
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.services import OWNER_EPOCH_METADATA_KEY
from splitserve_runtime.tls import WORKER_ROLE

logger = logging.getLogger(__name__)
EXECUTE_METHOD = "/splitserve.worker.v1.WorkerService/Execute"
_CLOSE = b""


def _frame_execute_request(scheduler_output: bytes) -> bytes:
    """Serialised ExecuteRequest holding an already serialised SchedulerOutput (field 1,
    length-delimited), so the step is encoded once without copying a message."""
    size = len(scheduler_output)
    varint = bytearray()
    while True:
        byte = size & 0x7F
        size >>= 7
        varint.append(byte | (0x80 if size else 0))
        if not size:
            break
    return b"\x0a" + bytes(varint) + scheduler_output


def _identity(payload: bytes) -> bytes:
    return payload


@dataclass(slots=True)
class _InFlight:
    """A step sent to the ranks and not answered yet."""

    step_id: int
    num_tokens: int
    sent: float
    """perf_counter when it was sent."""


class _RankStream:
    """One rank's Execute stream: an outbox feeding gRPC, and its replies."""

    def __init__(
        self,
        rank: int,
        addr: str,
        security: ChannelSecurity,
        owner_epoch: int,
        grpc_metrics: GrpcClientMetrics | None,
    ) -> None:
        self.rank, self.addr = rank, addr
        self.channel = open_channel(addr, security, grpc_metrics)
        method = self.channel.stream_stream(
            EXECUTE_METHOD,
            request_serializer=_identity,
            response_deserializer=worker_pb2.ExecuteResponse.FromString,
        )
        self.outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.replies: Iterator[worker_pb2.ExecuteResponse] = method(
            iter(self.outbox.get, _CLOSE),
            metadata=security.call_metadata((OWNER_EPOCH_METADATA_KEY, str(owner_epoch))),
        )

    def close(self) -> None:
        self.outbox.put(_CLOSE)
        self.replies.cancel()  # type: ignore[attr-defined]
        self.channel.close()


class GrpcExecutor:
    """Executor over gRPC; see the module docstring."""

    def __init__(
        self,
        addrs: list[str],
        output_rank: int,
        timeout: StepTimeout,
        on_failure: Callable[[GrpcExecutor, str, FaultCause], None],
        on_timing: Callable[[float, float], None],
        security: ChannelSecurity | None = None,
        owner_epoch: int = 0,
        grpc_metrics: GrpcClientMetrics | None = None,
    ) -> None:
        self._addrs = addrs
        self._grpc_metrics = grpc_metrics
        self._security = security or ChannelSecurity(None, WORKER_ROLE)
        self._owner_epoch = owner_epoch
        self.output_rank = output_rank
        self.timeout = timeout
        self._on_failure = on_failure
        self._on_timing = on_timing
        self._streams: list[_RankStream] = []
        self._lock = threading.Lock()
        self._in_flight: deque[_InFlight] = deque()
        self._step_started: float | None = None
        """monotonic time the oldest step in flight started running (for the watchdog)."""
        self._step_timeout = 0.0
        self._last_reply = 0.0
        """perf_counter of the latest reply: a step sent before it waited for its turn."""
        self._stopped = threading.Event()
        self.failure: str | None = None
        self.failure_cause: FaultCause = "rank_died"
        self._kv_reports = KvReports(len(addrs)) if len(addrs) > 1 else None
        """Every rank's KV-transfer reports, merged (a KV connector with more than one rank)."""

    @property
    def has_stepped(self) -> bool:
        """Whether any step ran to its end on these ranks."""
        return self.timeout.has_observed

    def open(self) -> None:
        """Open one Execute stream per rank; start the watchers and the watchdog."""
        self._streams = [
            _RankStream(rank, addr, self._security, self._owner_epoch, self._grpc_metrics)
            for rank, addr in enumerate(self._addrs)
        ]
        for stream in self._streams:
            if stream.rank != self.output_rank:
                threading.Thread(
                    target=self._watch,
                    args=(stream,),
                    daemon=True,
                    name=f"watch-rank-{stream.rank}",
                ).start()
        threading.Thread(target=self._watchdog, daemon=True, name="step-watchdog").start()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank (busy-loop thread); raise ExecutorError on any failure."""
        self.submit_model(scheduler_output)
        return self.collect_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step to every rank without waiting (busy-loop thread)."""
        if self.failure is not None:
            raise ExecutorError(self.failure, self.failure_cause)
        body = convert.scheduler_output_to_proto(scheduler_output).SerializeToString()
        payload = _frame_execute_request(body)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        self._in_flight.append(_InFlight(scheduler_output.step_id, num_tokens, time.perf_counter()))
        if len(self._in_flight) == 1:
            self._start_timeout_clock(num_tokens)
        for stream in self._streams:
            stream.outbox.put(payload)

    def submit_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """Send the grammar bitmask of a step sent with has_pending_grammar (busy-loop
        thread): every rank waits for it after the step's forward, before sampling."""
        if self.failure is not None:
            raise ExecutorError(self.failure, self.failure_cause)
        payload = convert.grammar_output_to_proto(scheduler_output).SerializeToString()
        for stream in self._streams:
            stream.outbox.put(payload)

    def send_profile(self, action: int, prefix: str) -> None:
        """Start (1) or stop (2) every rank's profiler (busy-loop thread), after the steps sent
        before; the ranks do not answer (a failure to write a trace is logged there)."""
        if self.failure is not None:
            return
        command = common_pb2.ProfileCommand(action=action, prefix=prefix)  # type: ignore[arg-type]
        payload = worker_pb2.ExecuteRequest(profile=command).SerializeToString()
        for stream in self._streams:
            stream.outbox.put(payload)

    def _start_timeout_clock(self, num_tokens: int) -> None:
        self._step_timeout = self.timeout.seconds(num_tokens)
        self._step_started = time.monotonic()

    def collect_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Wait for the oldest step in flight's output, `scheduler_output` (busy-loop thread);
        raise ExecutorError on any failure."""
        if not self._in_flight or self._in_flight[0].step_id != scheduler_output.step_id:
            raise ExecutorError(self.failure or "collected a step that was not sent first")
        reply = self._read_output_rank()
        step = self._in_flight.popleft()
        assert self._step_started is not None
        self.timeout.observe(step.num_tokens, time.monotonic() - self._step_started)
        self._step_started = None
        if self._in_flight:
            self._start_timeout_clock(self._in_flight[0].num_tokens)
        now = time.perf_counter()
        self._on_timing(now - max(step.sent, self._last_reply), reply.timings.total_seconds)
        self._last_reply = now
        return self._check_reply(reply, scheduler_output)

    def _check_reply(
        self, reply: worker_pb2.ModelRunnerOutput, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        if reply.status == worker_pb2.STEP_STATUS_ERROR:
            self._fail(
                f"worker rank {reply.rank} failed step {reply.step_id}: {reply.error_message}"
            )
            raise ExecutorError(self.failure or reply.error_message, self.failure_cause)
        if reply.step_id != scheduler_output.step_id:
            self._fail(
                f"worker rank {self.output_rank} answered step {reply.step_id} to step "
                f"{scheduler_output.step_id}"
            )
            raise ExecutorError(self.failure or "step out of order", self.failure_cause)
        try:
            output = convert.model_runner_output_from_proto(reply)
        except ValueError as err:
            self._fail(f"worker rank {reply.rank} sent a malformed output: {err}")
            raise ExecutorError(self.failure or str(err), self.failure_cause) from None
        if self._kv_reports is not None:
            output.kv_connector_output = self._kv_reports.merge(output.kv_connector_output)
        return output

    def _read_output_rank(self) -> worker_pb2.ModelRunnerOutput:
        stream = self._streams[self.output_rank]
        try:
            return next(stream.replies).model_runner_output
        except StopIteration:
            self._fail(f"worker rank {stream.rank} ({stream.addr}) closed its stream")
        except grpc.RpcError as err:
            self._fail(
                f"worker rank {stream.rank} ({stream.addr}) is unreachable: "
                f"{err.code().name}: {err.details()}"
            )
        raise ExecutorError(self.failure or "executor failed", self.failure_cause)

    def _watch(self, stream: _RankStream) -> None:
        """Read a non-output rank: it answers only to report an error, or (with a KV connector)
        its transfers."""
        try:
            for reply in stream.replies:
                out = reply.model_runner_output
                if out.status == worker_pb2.STEP_STATUS_ERROR:
                    self._fail(
                        f"worker rank {stream.rank} ({stream.addr}) failed step "
                        f"{out.step_id}: {out.error_message}"
                    )
                    return
                if out.HasField("kv_connector_output") and self._kv_reports is not None:
                    self._kv_reports.add(k_v_connector_output_from_proto(out.kv_connector_output))
            self._fail(f"worker rank {stream.rank} ({stream.addr}) closed its stream")
        except grpc.RpcError as err:
            self._fail(
                f"worker rank {stream.rank} ({stream.addr}) is unreachable: "
                f"{err.code().name}: {err.details()}"
            )

    def _watchdog(self) -> None:
        """Fail the executor when a step outlives its timeout (a hung or stopped rank)."""
        while not self._stopped.wait(0.25):
            started, timeout = self._step_started, self._step_timeout
            if started is not None and time.monotonic() - started > timeout:
                self._fail(
                    f"a step got no answer from worker rank {self.output_rank} within its "
                    f"timeout of {timeout:.1f} s (a rank is hung or stopped)",
                    "rank_hung",
                )

    def _fail(self, message: str, cause: FaultCause = "rank_died") -> None:
        """First failure wins: report it once and cancel the output rank's stream, which wakes a
        step blocked on it (any thread)."""
        with self._lock:
            if self.failure is not None or self._stopped.is_set():
                return
            self.failure, self.failure_cause = message, cause
        logger.error("executor failed: %s", message)
        self._on_failure(self, message, cause)
        self._streams[self.output_rank].replies.cancel()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Close every stream (any thread)."""
        self._stopped.set()
        with self._lock:
            self.failure = self.failure or "the executor was shut down"
        for stream in self._streams:
            stream.close()
