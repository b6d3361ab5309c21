"""A service that returned from main() ends with its code, its logs and output flushed, and
without the interpreter's teardown (splitserve_runtime/process_exit.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys
    from splitserve_runtime.process_exit import exit_now

    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    logging.getLogger("svc").info("svc stopped")
    atexit.register(lambda: print("interpreter teardown ran", flush=True))
    sys.stdout.write("last words, unflushed")
    exit_now(3)
    """
)


def test_exit_now_flushes_and_skips_the_interpreters_teardown(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last words, unflushed"  # flushed; the atexit hook never ran
    assert "svc stopped" in log.read_text()
