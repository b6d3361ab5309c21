"""splitserve/supervisor.py on real processes: a child that exits is started again with its
command line; one that exits again before it is ready, or too often, is down for good."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve import supervisor
from splitserve.children import Child, LaunchError
from splitserve.supervisor import Supervisor

EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def child(tmp_path: Path, command: list[str], wait: bool = True) -> Child:
    message = tmp_path / "termination-message"
    message.write_text("the last life's reason")
    process = subprocess.Popen(command)
    if wait:
        process.wait(30)
    found = Child("worker[1]", "worker", "127.0.0.1:1", "", process, message)
    found.command, found.env = command, {}
    return found


@pytest.fixture
def ready(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether restarted children answer their readiness check (set by the test)."""
    answer = [False]
    monkeypatch.setattr(supervisor, "is_ready", lambda child: answer[0])
    yield answer


def test_an_exited_child_is_restarted_with_its_command(tmp_path: Path, ready: list[bool]) -> None:
    dead = child(tmp_path, EXIT_3)
    first = dead.process
    lines: list[str] = []
    watcher = Supervisor([dead], report=lines.append)
    watcher.poll()
    assert dead.process is not first and dead.process.args == EXIT_3
    assert watcher.num_restarts == 1 and "exited with code 3" in lines[0]
    assert dead.termination_message.read_text() == ""  # the new life writes its own reason
    dead.process.wait(30)
    with pytest.raises(LaunchError, match="again, before it was ready"):
        watcher.poll()


def test_a_child_that_keeps_dying_is_down_for_good(tmp_path: Path, ready: list[bool]) -> None:
    living = child(tmp_path, SLEEP, wait=False)
    lines: list[str] = []
    watcher = Supervisor([living], max_restarts=2, report=lines.append)
    ready[0] = True
    try:
        for _ in range(2):
            living.process.kill()  # a process this test started, by PID
            living.process.wait(30)
            watcher.poll()  # restarted
            watcher.poll()  # ready again
        assert watcher.num_restarts == 2 and lines[-1] == "worker[1] is ready again"
        living.process.kill()
        living.process.wait(30)
        with pytest.raises(LaunchError, match="2 restarts in the last 600 s"):
            watcher.poll()
    finally:
        living.process.kill()
        living.process.wait(30)
