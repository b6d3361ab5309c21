"""`splitserve up --no-internal-tls`: plaintext inside, but not open to the machine. The launcher
gives its services a random internal secret: a stranger calling the core or a worker directly is
refused (UNAUTHENTICATED) and reads no credential in any refusal, while the stack serves. The same
real `up` process shows its supervisor at work: a SIGKILLed worker rank is started again at its
port and the stream in flight resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as worker_grpc
from splitserve_runtime.services import INTERNAL_SECRET_METADATA_KEY, OWNER_EPOCH_METADATA_KEY
from tests.e2e.client import generate, join, text_request
from tests.e2e.stack import UP_ANY_METRICS_PORTS
from tests.fixtures.load_requests import load_request
from tests.security.peers import rpc_error

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SECRET_ENV = "SPLITSERVE_INTERNAL_SECRET"
Metadata = tuple[tuple[str, str], ...]


@dataclass
class Up:
    process: subprocess.Popen[str]
    frontend: str
    core: str
    worker: str
    core_metrics: str
    stderr: Path

    def children(self) -> dict[str, int]:
        """Service kind -> pid of the launcher's children (Linux /proc)."""
        pid = self.process.pid
        pids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        kinds = {}
        for child in pids:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            kinds[cmdline[2].decode().removesuffix("_svc")] = int(child)  # python -m KIND_svc
        return kinds


@pytest.fixture(scope="module")
def plaintext_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    env = dict(os.environ, SPLITSERVE_LOG_LEVEL="warning")
    for name in ("SPLITSERVE_API_KEY", SECRET_ENV):
        env.pop(name, None)
    stderr = tmp_path_factory.mktemp("up") / "up.err"
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [str(BIN / "splitserve"), "up", "--model", str(tiny_model_dir), "--grpc-port", "0"]
            + [*UP_ANY_METRICS_PORTS, "--http-port", "-1", "--no-internal-tls"]
            + ["--kv-cache-memory-bytes", "16777216", "--max-recovery-seconds", "90"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.fullmatch(r"READY frontend=(\S+) core=(\S+) workers=(\S+) metrics=(\S+)\n", line)
        assert match, line
        frontend, core, worker, metrics = match.groups()
        core_metrics = metrics.split(",")[-2]  # workers', core's, frontend's, in start order
        yield Up(process, frontend, core, worker, core_metrics, stderr)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _unary(addr: str, method: str, request: bytes, metadata: Metadata) -> Callable[[], object]:
    def call() -> object:
        with grpc.insecure_channel(addr) as ch:
            return ch.unary_unary(method)(request, timeout=30, metadata=metadata)

    return call


def _stream(addr: str, method: str, request: bytes, metadata: Metadata) -> Callable[[], object]:
    def call() -> object:
        with grpc.insecure_channel(addr) as ch:
            return list(ch.stream_stream(method)(iter([request]), timeout=30, metadata=metadata))

    return call


def _stranger_calls(up: Up, metadata: Metadata) -> dict[str, Callable[[], object]]:
    core, worker = "/splitserve.core.v1.EngineCoreService/", "/splitserve.worker.v1.WorkerService/"
    add = core_pb2.EngineStreamRequest(
        add=core_pb2.AddRequests(
            requests=[
                core_pb2.EngineCoreRequest(request_handle=1, prompt_token_ids=[5], max_tokens=1)
            ]
        )
    )
    takeover = load_request(model_path="tiny", owner_epoch=2**63 - 1)
    step = worker_pb2.ExecuteRequest(scheduler_output=worker_pb2.SchedulerOutput(step_id=1))
    return {
        "core Handshake": _unary(
            up.core, core + "Handshake", core_pb2.HandshakeRequest().SerializeToString(), metadata
        ),
        "core EngineStream": _stream(
            up.core, core + "EngineStream", add.SerializeToString(), metadata
        ),
        "core ResetPrefixCache": _unary(
            up.core,
            core + "ResetPrefixCache",
            core_pb2.ResetPrefixCacheRequest().SerializeToString(),
            metadata,
        ),
        "worker Describe": _unary(
            up.worker,
            worker + "Describe",
            worker_pb2.DescribeRequest().SerializeToString(),
            metadata,
        ),
        "worker Execute": _stream(
            up.worker, worker + "Execute", step.SerializeToString(), metadata
        ),
        "worker LoadModel (a takeover)": _unary(
            up.worker, worker + "LoadModel", takeover.SerializeToString(), metadata
        ),
    }


def test_a_stranger_without_the_launchers_secret_is_refused(plaintext_up: Up) -> None:
    refusals = []
    for metadata in ((), ((INTERNAL_SECRET_METADATA_KEY, "not-the-secret-0123"),)):
        for name, call in _stranger_calls(plaintext_up, metadata).items():
            err = rpc_error(call)
            refusals.append(err.details() or "")
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (name, refusals[-1])
            assert not re.search(r"\d{5}", refusals[-1]), refusals[-1]  # no epoch
    children = plaintext_up.children()
    secret = _environ(children["core"]).get(SECRET_ENV, "")
    assert len(secret) >= 32  # a random one, made by the launcher
    assert not any(secret[:8] in text for text in refusals)
    assert all(_environ(pid).get(SECRET_ENV) == secret for pid in children.values())
    assert not any(secret.encode() in _cmdline(pid) for pid in children.values())
    # A peer with the secret but a guessed epoch: refused, and the owner's epoch not named.
    knows = ((INTERNAL_SECRET_METADATA_KEY, secret), (OWNER_EPOCH_METADATA_KEY, "1"))
    with grpc.insecure_channel(plaintext_up.worker) as ch:
        stub = worker_grpc.WorkerServiceStub(ch)
        step = worker_pb2.ExecuteRequest(scheduler_output=worker_pb2.SchedulerOutput(step_id=1))
        err = rpc_error(lambda: list(stub.Execute(iter([step]), timeout=30, metadata=knows)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not re.search(r"\d{4}", err.details() or ""), err.details()
        request = worker_pb2.GetKvCapacityRequest(kv_cache_memory_bytes=1 << 20)
        err = rpc_error(lambda: stub.GetKvCapacity(request, timeout=30, metadata=knows))
        assert not re.search(r"\d{4}", err.details() or ""), err.details()
    with grpc.insecure_channel(plaintext_up.core) as ch:
        core = core_grpc.EngineCoreServiceStub(ch)
        reply = core.Handshake(core_pb2.HandshakeRequest(), timeout=30, metadata=knows[:1])
        assert reply.engine_info.vocab_size > 0
    # The stack itself, whose services present the secret to each other, serves.
    (completion,) = generate(plaintext_up.frontend, text_request("hi", max_tokens=4)).values()
    assert len(completion.token_ids) == 4


@pytest.mark.extended  # the same supervisor restarts ranks in make test's test_recovery.py
def test_up_restarts_a_killed_worker_and_the_stream_in_flight_resumes(plaintext_up: Up) -> None:
    resumed_before = _resumed(plaintext_up.core_metrics)
    old_worker = plaintext_up.children()["worker"]
    request = text_request("a long story", max_tokens=1500, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(plaintext_up.frontend) as ch:
        responses = gen_grpc.GenerationServiceStub(ch).Generate(request, timeout=240)
        first = next(responses)
        os.kill(old_worker, signal.SIGKILL)
        (completion,) = join(responses).values()
    assert len(first.token_ids) + len(completion.token_ids) == 1500
    assert completion.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert _resumed(plaintext_up.core_metrics) > resumed_before  # it was in flight
    assert _wait_for(lambda: "worker[0] is ready again" in plaintext_up.stderr.read_text())
    lines = plaintext_up.stderr.read_text()
    assert "worker[0] exited with code -9; restarting it (same port and flags)" in lines
    assert plaintext_up.children()["worker"] != old_worker
    (after,) = generate(plaintext_up.frontend, text_request("hi", max_tokens=3)).values()
    assert len(after.token_ids) == 3


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _resumed(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "splitserve_engine_requests_resumed_total":
                return float(sample.value)
    raise AssertionError("no splitserve_engine_requests_resumed_total")


def _wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
