"""A restarted engine core against a rank that does not answer (issue 11, item 8: a restarted
core once hung in bring-up on a wedged worker): its start-up calls time out and are retried,
and once the rank answers again the core takes it over and the engine serves."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from splitserve.children import is_ready
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DESCRIBE_TIMEOUT_S = 5.0
"""core_svc.worker_pool waits this long for one Describe before it tries again."""


def _serves(frontend: str) -> bool:
    try:
        return bool(
            generate(frontend, text_request("hello", max_tokens=2), timeout=30)[0].token_ids
        )
    except grpc.RpcError:
        return False


def test_a_restarted_core_outwaits_a_stopped_rank_and_takes_it_over(tiny_model_dir: Path) -> None:
    stack = Stack(tiny_model_dir, core_flags=["--worker-connect-timeout", "300"]).start()
    worker, core = next(stack.workers()).process, stack.child("core")
    try:
        assert _serves(stack.frontend)
        os.kill(worker.pid, signal.SIGSTOP)  # the rank stops answering, its port stays open
        argv = list(core.process.args)  # type: ignore[arg-type]
        core.process.kill()
        core.process.wait()
        core.process = subprocess.Popen(argv)  # same flags, a later epoch
        time.sleep(2 * DESCRIBE_TIMEOUT_S)  # let its first calls to the rank time out
        assert core.process.poll() is None, "the core gave up on a rank that did not answer"
        assert not is_ready(core)
        os.kill(worker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 240
        while not _serves(stack.frontend):
            assert core.process.poll() is None, core.exit_reason(core.process.returncode or 0)
            assert time.monotonic() < deadline, "the engine never served again"
            time.sleep(0.5)
        assert is_ready(core)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        stack.stop()
