"""Ownership of worker ranks: only the core that loaded a rank may drive it; a restarted core
(same identity, larger epoch) takes it over deliberately; a bad LoadModel never unloads it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitserve.local_pki import LAUNCHER_IDENTITY, LocalPki
from splitserve.loopback_ports import free_ports
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from splitserve_runtime.tls import CORE_ROLE, FRONTEND_ROLE, WORKER_ROLE, TlsFiles
from tests.fixtures.load_requests import load_request
from tests.security.peers import EPOCH_KEY, channel, health_status, issue, rpc_error
from worker_svc.ownership import Claim, NotOwner, Ownership, StaleClaim

BLOCK_SIZE = 4


def test_ownership_rules() -> None:
    owner, stranger = Claim("splitserve-core", 10), Claim("core-b,splitserve-core", 99)
    ownership = Ownership()
    assert ownership.check_load(stranger, is_loaded=False) is False  # an idle rank: anyone
    ownership.loaded_by(owner)
    with pytest.raises(NotOwner):
        ownership.check_load(stranger, is_loaded=True)
    for epoch in (10, 9):
        with pytest.raises(StaleClaim):
            ownership.check_load(Claim(owner.identity, epoch), is_loaded=True)
    assert ownership.check_load(Claim(owner.identity, 11), is_loaded=True) is True  # takeover
    ownership.check_call(owner)
    with pytest.raises(NotOwner):
        ownership.check_call(stranger)
    with pytest.raises(StaleClaim):
        ownership.check_call(Claim(owner.identity, 11))


def test_refusals_never_name_the_owners_epoch() -> None:
    """Under plaintext the epoch is the owner's only credential: a refusal that named it would
    hand it to whoever was refused."""
    owner_epoch = 1_754_000_000_123_456_789
    ownership = Ownership()
    ownership.loaded_by(Claim("", owner_epoch))
    refusals = []
    for epoch in (owner_epoch, owner_epoch - 1, 0):
        with pytest.raises(StaleClaim) as load:
            ownership.check_load(Claim("", epoch), is_loaded=True)
        refusals.append(str(load.value))
    for epoch in (owner_epoch - 1, owner_epoch + 1, 0):
        with pytest.raises(StaleClaim) as call:
            ownership.check_call(Claim("", epoch))
        refusals.append(str(call.value))
    with pytest.raises(NotOwner) as stranger:
        ownership.check_call(Claim("splitserve-core", owner_epoch))
    refusals.append(str(stranger.value))
    for text in refusals:
        assert not re.search(r"\d{4}", text), text


def _epoch(epoch: int) -> tuple[tuple[str, str], ...]:
    return ((EPOCH_KEY, str(epoch)),)


def _load(model: str, epoch: int) -> pb.LoadModelRequest:
    return load_request(model_path=model, block_size=BLOCK_SIZE, owner_epoch=epoch)


def _first_step() -> pb.ExecuteRequest:
    new = pb.NewRequestData(
        req_handle=1,
        request_id="r1",
        prompt_token_ids=[7, 8, 9, 10, 11],
        block_ids=[1, 2],
        sampler_params=types_pb2.SamplerParams(temperature=0.0),
    )
    step = pb.SchedulerOutput(
        step_id=1, scheduled_new_reqs=[new], num_scheduled_tokens=[5], total_num_scheduled_tokens=5
    )
    return pb.ExecuteRequest(scheduler_output=step)


@pytest.fixture(scope="module")
def tls_worker(pki: LocalPki) -> Iterator[str]:
    """A worker process serving mutual TLS with the `pki` certificates."""
    port, metrics = free_ports(2)
    files = pki.files[WORKER_ROLE]
    process = subprocess.Popen(
        [sys.executable, "-m", "worker_svc", "--host", "127.0.0.1", "--port", str(port)]
        + ["--metrics-port", str(metrics), "--device", "cpu", "--log-level", "warning"]
        + ["--tls-cert-file", files.cert_file, "--tls-key-file", files.key_file]
        + ["--tls-ca-file", files.ca_file]
    )
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if health_status(addr, pki.files[LAUNCHER_IDENTITY], WORKER_ROLE) == 1:
                    break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the worker never served"
                time.sleep(0.2)
        yield addr
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_only_the_owning_core_drives_a_rank(
    tls_worker: str, pki: LocalPki, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = str(tiny_model_dir)
    stranger = issue(pki.ca, tmp_path, "stranger", [CORE_ROLE, "splitserve-core-b"])
    core, frontend = pki.files[CORE_ROLE], pki.files[FRONTEND_ROLE]

    def stub(files: TlsFiles) -> pb_grpc.WorkerServiceStub:
        return pb_grpc.WorkerServiceStub(channel(tls_worker, files, WORKER_ROLE))

    def load_error(files: TlsFiles, request: pb.LoadModelRequest) -> grpc.StatusCode:
        return rpc_error(lambda: stub(files).LoadModel(request, timeout=120)).code()

    assert load_error(frontend, _load(model, 1)) == grpc.StatusCode.PERMISSION_DENIED  # role
    stub(core).LoadModel(_load(model, 100), timeout=120)
    assert load_error(stranger, _load(model, 999)) == grpc.StatusCode.PERMISSION_DENIED
    assert load_error(core, _load(model, 100)) == grpc.StatusCode.FAILED_PRECONDITION
    assert load_error(core, _load(model, 50)) == grpc.StatusCode.FAILED_PRECONDITION
    # A takeover to a checkpoint that does not exist is refused before the rank unloads.
    assert load_error(core, _load(str(tmp_path / "no-model"), 200)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    owner = stub(core)
    owner.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16), metadata=_epoch(100))
    (reply,) = owner.Execute(iter([_first_step()]), metadata=_epoch(100), timeout=60)
    assert reply.model_runner_output.status == pb.STEP_STATUS_OK  # still serving its owner
    for files, epoch, code in (
        (stranger, 100, grpc.StatusCode.PERMISSION_DENIED),
        (core, 99, grpc.StatusCode.FAILED_PRECONDITION),
    ):
        calls = stub(files).Execute(iter([_first_step()]), metadata=_epoch(epoch), timeout=60)
        assert rpc_error(lambda c=calls: list(c)).code() == code
    # The same core restarted (a larger epoch) takes the rank over; the old epoch is out.
    stub(core).LoadModel(_load(model, 300), timeout=120)
    old = stub(core).Execute(iter([_first_step()]), metadata=_epoch(100), timeout=60)
    assert rpc_error(lambda: list(old)).code() == grpc.StatusCode.FAILED_PRECONDITION
