"""`splitserve serve MODEL` as an operator from vLLM runs it: the positional model, a --config
file, -tp, --enforce-eager, JSON logs with the periodic stats line, per-request lines and the
load line; `generate` and `bench serve` find the server without --addr; SIGTERM removes the
recorded address."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.stack import UP_ANY_METRICS_PORTS
from tests.fixtures.kernel_cache import fresh_cache_with_kernels

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
CONFIG = """\
max_model_len: 512
kv_cache_memory_bytes: 16777216
http_port: 0
frontend_metrics_port: 0
core-metrics-port: 0
worker_metrics_port: 0
log_format: json
enable_log_requests: true
log_stats_interval: 0.5
"""


def client(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "splitserve"), *args], capture_output=True, text=True, timeout=120, env=env
    )


def log_records(text: str) -> list[dict[str, str]]:
    """Every stderr line but the launcher's own plain last words is a JSON object."""
    lines = [line for line in text.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")]
    return records


def wait_for_messages(path: Path, is_done: Callable[[list[str]], bool]) -> None:
    """Until the messages of the whole JSON lines in `path` satisfy `is_done` (30 s at most:
    the assertions after it say what is missing)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        text = path.read_text()
        lines = text[: text.rfind("\n") + 1].splitlines()
        if is_done([json.loads(line)["message"] for line in lines if line.startswith("{")]):
            return
        time.sleep(0.05)


def is_logged(messages: list[str]) -> bool:
    """The four requests' lines and a stats line that counted generated tokens."""
    stats = [m for m in messages if "Avg prompt throughput" in m]
    return sum(m.startswith("Finished request") for m in messages) == 4 and any(
        "Avg generation throughput: 0.0" not in m for m in stats
    )


def test_serve_a_model_positionally_with_a_config_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    cache = fresh_cache_with_kernels(tmp_path / "cache")
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)}
    for name in ("SPLITSERVE_ADDR", "SPLITSERVE_LOG_LEVEL", "SPLITSERVE_API_KEY"):
        env.pop(name, None)
    stderr_path = tmp_path / "serve.err"
    with stderr_path.open("w") as stderr:
        serve = subprocess.Popen(
            [str(BIN / "splitserve"), "serve", str(tiny_model_dir), "--config", str(config)]
            + ["--grpc-port", "0", "-tp", "1", "--enforce-eager"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline()
            match = re.match(r"READY frontend=(\S+) .* http=(\S+)\n", line)
            assert match, line
            state = cache / "last-serve.json"
            recorded = json.loads(state.read_text())
            assert (recorded["frontend"], recorded["http"]) == match.groups()

            generated = client("generate", "The quick brown fox", "--max-tokens", "6", env=env)
            assert generated.returncode == 0, generated.stderr
            assert generated.stdout.endswith("\n") and generated.stdout.strip()
            bench = client("bench", "serve", "--num-prompts", "3", "--input-len", "8", "--json",
                           "--output-len", "4", env=env)  # fmt: skip
            assert bench.returncode == 0, bench.stderr
            assert json.loads(bench.stdout.splitlines()[-1])["completed"] == 3
            wait_for_messages(stderr_path, is_logged)  # the stats line comes every 0.5 s
        finally:
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=90) == 0
    assert not state.exists()
    records = log_records(stderr_path.read_text())
    assert {r["service"] for r in records} >= {"launcher", "worker", "core", "frontend"}
    messages = [r["message"] for r in records]
    loading = [m for m in messages if m.startswith("loading ") and "enforce_eager" in m]
    assert loading and any(m.startswith("Model loading took ") for m in messages)
    assert "Asynchronous scheduling is enabled (--no-async-scheduling: lockstep)" in messages
    assert any(m.startswith("CPU kernels loaded from ") for m in messages)
    stats = [m for m in messages if "Avg prompt throughput" in m]
    assert stats and all("CPU KV cache usage" in m for m in stats)
    assert any("Avg generation throughput: 0.0" not in m for m in stats)
    finished = [m for m in messages if m.startswith("Finished request")]
    assert len(finished) == 4  # generate's request and bench's three
    assert all("The quick" not in m for m in finished)  # no prompt text by default


def test_the_sample_answer_is_one_line_however_much_the_services_log(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`splitserve up --sample-prompt` (make run) on a terminal, stdout and stderr on one file:
    the services' log lines written while the answer streams (a stats line every 0.02 s) wait
    until its line is complete, then all come (issue 37, item 4)."""
    cache = fresh_cache_with_kernels(tmp_path / "cache")
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)}
    terminal = tmp_path / "terminal"
    with terminal.open("wb") as out:
        up = subprocess.Popen(
            [str(BIN / "splitserve"), "up", str(tiny_model_dir), "--grpc-port", "0"]
            + ["--http-port", "0", *UP_ANY_METRICS_PORTS, "--log-level", "info"]
            + ["--log-stats-interval", "0.02", "--sample-prompt", "The capital of France is"],
            stdout=out,
            stderr=out,
            env=env,
        )
        try:
            deadline = time.monotonic() + 240
            while "Running: 0 reqs" not in terminal.read_text().partition("sample answer:")[2]:
                assert up.poll() is None and time.monotonic() < deadline, terminal.read_text()
                time.sleep(0.1)
        finally:
            up.send_signal(signal.SIGTERM)
            assert up.wait(timeout=90) == 0
    lines = terminal.read_text().splitlines()
    [answer] = [i for i, line in enumerate(lines) if line.startswith("sample answer:")]
    assert lines[answer - 1] == "sample prompt: The capital of France is", lines[answer - 1]
    assert " INFO " not in lines[answer] and len(lines[answer]) > len("sample answer: "), lines
    stats = [line for line in lines[answer:] if "core INFO core_svc.stats_logger" in line]
    assert any("Running: 1 reqs" in line for line in stats), lines[answer:]  # held, then shown
    assert all(re.match(r"\d\d:\d\d:\d\d \w+ [A-Z]+ ", line) for line in stats)
