"""HeldLogs (splitserve/held_logs.py), the seam between `splitserve up`'s sample answer and the
services' log lines (issue 37, item 4): a child that logs while the answer streams, stdout and
stderr on one file as on a terminal. The answer's line comes out whole, every log line comes out
whole and none is lost; the lines from before the hold come before the answer, those from
during it after. Run in a subprocess: HeldLogs takes over file descriptor 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NUM_TOKENS = 20
CHILD = """
import sys
sys.stderr.write("12:00:00 core INFO startup: ready\\n")  # one write, as logging's
for i, _ in enumerate(sys.stdin):
    sys.stderr.write(f"12:00:00 core INFO stats: line {i}\\n")
    print("logged", flush=True)
"""
SCRIPT = f"""
import subprocess, sys
from splitserve.held_logs import HeldLogs

logs = HeldLogs() if sys.argv[1] == "held" else None
child = subprocess.Popen(
    [sys.executable, "-c", {CHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)

def child_logs():  # one line, and wait until it is written
    child.stdin.write("go\\n")
    child.stdin.flush()
    assert child.stdout.readline() == "logged\\n"

child_logs()
sys.stdout.write("READY\\n")  # as the launcher writes it: one write
sys.stdout.flush()
with logs.held() if logs else open("/dev/null"):
    print("sample answer:", end="", flush=True)
    for i in range({NUM_TOKENS}):
        print(f" tok{{i}}", end="", flush=True)
        child_logs()
    print(flush=True)
child_logs()
child.stdin.close()
child.wait()
if logs:
    logs.close()
print("after", file=sys.stderr, flush=True)
"""
ANSWER = "sample answer:" + "".join(f" tok{i}" for i in range(NUM_TOKENS))


def run(tmp_path: Path, mode: str) -> list[str]:
    out = tmp_path / f"{mode}.out"
    with out.open("wb") as terminal:
        subprocess.run(
            [sys.executable, "-c", SCRIPT, mode],
            stdout=terminal,
            stderr=terminal,
            timeout=60,
            check=True,
            cwd=Path(__file__).parents[3],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # print's text and end: two writes
        )
    return out.read_text().splitlines()


def test_the_answer_streams_whole_and_every_log_line_comes_after_it(tmp_path: Path) -> None:
    lines = run(tmp_path, "held")
    logged = [line for line in lines if line.startswith("12:00:00")]
    assert logged == [
        "12:00:00 core INFO startup: ready",
        *(f"12:00:00 core INFO stats: line {i}" for i in range(NUM_TOKENS + 2)),
    ], lines
    answer = lines.index(ANSWER)
    # Before the answer, at most the lines logged before it (the relay runs beside READY).
    assert set(lines[:answer]) <= {"READY", *logged[:2]} and "READY" in lines[:answer], lines
    assert len(lines) == len(logged) + 3 and lines[-1] == "after", lines


def test_without_the_hold_the_log_lines_cut_the_answer(tmp_path: Path) -> None:
    """The failure the hold prevents: the services wrote to the launcher's stderr directly."""
    lines = run(tmp_path, "inherited")
    assert ANSWER not in lines
    assert "sample answer: tok012:00:00 core INFO stats: line 1" in lines, lines
    assert "12:00:00 core INFO stats: line 2" not in lines  # it was inside the answer's line
