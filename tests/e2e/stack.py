"""A real splitserve stack (worker, core and frontend processes on loopback) for end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc

from splitserve.children import (
    Child,
    StackOptions,
    start_children,
    start_frontend,
    stop_children,
    wait_ready,
)
from splitserve.local_pki import LocalPki
from splitserve.supervisor import Supervisor
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_runtime.channels import ChannelSecurity

KV_BYTES = str(64 * 1024 * 1024)
# `splitserve up` serves metrics on stable ports (9400, 9401, 9402 + rank); tests that run it
# take free ones, so that they can run beside each other and beside a `make run`.
UP_ANY_METRICS_PORTS = [
    *("--frontend-metrics-port", "0"),
    *("--core-metrics-port", "0"),
    *("--worker-metrics-port", "0"),
]


class Stack:
    """Processes started with the launcher's own wiring; stopped by PID. Internal hops are
    plaintext unless `pki` gives their certificates; `api_key` guards the frontend;
    `frontend_flags` go to every frontend (e.g. --max-inflight-requests). With
    `supervise`, children that exit once the stack is ready are restarted as `splitserve up`
    restarts them; `max_recovery_seconds` goes to the core and the frontend; `tokenizer` is the
    frontends' --tokenizer."""

    def __init__(
        self,
        model: Path | str,
        tp: int = 1,
        pp: int = 1,
        core_flags: list[str] | None = None,
        pki: LocalPki | None = None,
        api_key: str = "",
        revision: str = "",
        generation_config: str = "auto",
        frontend_flags: list[str] | None = None,
        frontend_probe: ChannelSecurity | None = None,
        supervise: bool = False,
        max_recovery_seconds: float | None = None,
        tokenizer: str = "",
        worker_flags: list[str] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.revision, self.generation_config = revision, generation_config
        self.tp, self.pp = tp, pp
        self.pki, self.api_key = pki, api_key
        self.core_flags = ["--kv-cache-memory-bytes", KV_BYTES, *(core_flags or [])]
        self.frontend_flags = list(frontend_flags or [])
        self.worker_flags = list(worker_flags or [])
        self.frontend_probe = frontend_probe
        """How readiness reaches the frontend's port when it serves TLS (default: plaintext)."""
        self.children: list[Child] = []
        self.supervise, self.max_recovery_seconds = supervise, max_recovery_seconds
        self.supervisor: Supervisor | None = None

    def options(self, api_key: str | None = None) -> StackOptions:
        return StackOptions(
            str(self.model),
            revision=self.revision,
            tokenizer=self.tokenizer,
            generation_config=self.generation_config,
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            api_key=self.api_key if api_key is None else api_key,
            service_flags={
                "core": self.core_flags,
                "frontend": self.frontend_flags,
                "worker": self.worker_flags,
            },
            log_level=os.environ.get("SPLITSERVE_TEST_LOG_LEVEL", "warning"),
            max_recovery_seconds=self.max_recovery_seconds,
        )

    def start(self, timeout: float = 240.0) -> Stack:
        self.children = start_children(self.options(), self.pki)
        if self.frontend_probe is not None:
            self.child("frontend").probe = self.frontend_probe
        try:
            wait_ready(self.children, timeout)
        except Exception:
            self.stop()
            raise
        if self.supervise:
            self.supervisor = Supervisor(self.children).start()
        return self

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        stop_children(self.children)

    def add_frontend(self, api_key: str = "", timeout: float = 120.0) -> Child:
        """Another frontend process on this stack's core (stop it with stop_children)."""
        child = start_frontend(self.options(api_key), self.core, self.pki)
        try:
            wait_ready([child], timeout)
        except Exception:
            stop_children([child])
            raise
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    @property
    def frontend(self) -> str:
        return self.child("frontend").address

    @property
    def http(self) -> str:
        """Base URL of the frontend's OpenAI-compatible HTTP API, e.g. http://127.0.0.1:8000."""
        return f"http://{self.child('frontend').http_address}"

    @property
    def core(self) -> str:
        return self.child("core").address

    def workers(self) -> Iterator[Child]:
        return (c for c in self.children if c.kind == "worker")

    @property
    def worker(self) -> str:
        return next(self.workers()).address

    def scheduler_stats(self) -> core_pb2.SchedulerStats:
        with grpc.insecure_channel(self.core) as channel:
            stub = core_grpc.EngineCoreServiceStub(channel)
            reply = stub.GetSchedulerStats(core_pb2.GetSchedulerStatsRequest(), timeout=10)
            return reply.scheduler_stats
