"""Logs as operators read them (text or one JSON object per line) and the address `serve`
leaves for `generate` and `bench serve`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve_client.last_serve import (
    DEFAULT_ADDR,
    default_address,
    forget_serve,
    record_serve,
    state_path,
)
from splitserve_runtime.log_config import configure_logging, is_text_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_logs_are_one_object_per_line(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "core", "json")
    assert not is_text_logging()
    logging.getLogger("core_svc.demo").info("hello %s", "there")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("core_svc.demo").exception("it failed")
    logging.getLogger("core_svc.demo").debug("not at info")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"time", "level", "service", "logger", "message"}
    assert (first["level"], first["service"], first["logger"]) == ("INFO", "core", "core_svc.demo")
    assert first["message"] == "hello there" and first["time"].endswith("+00:00")
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_text_logs_name_the_service(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("warning", "worker")
    assert is_text_logging()
    logging.getLogger("worker_svc.demo").warning("careful")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" worker WARNING worker_svc.demo: careful")


def test_serve_records_its_address_for_the_clients(tmp_path: Path) -> None:
    env = {"SPLITSERVE_CACHE_DIR": str(tmp_path)}
    assert default_address(env) == DEFAULT_ADDR
    path = record_serve("0.0.0.0:50123", "127.0.0.1:8001", env)
    assert path == state_path(env) == tmp_path / "last-serve.json"
    entry = json.loads(path.read_text())
    assert entry == {"frontend": "127.0.0.1:50123", "http": "127.0.0.1:8001", "pid": os.getpid()}
    assert default_address(env) == "127.0.0.1:50123"
    forget_serve(env)
    assert not path.exists() and default_address(env) == DEFAULT_ADDR


def test_an_address_whose_launcher_is_gone_is_not_used(tmp_path: Path) -> None:
    env = {"SPLITSERVE_CACHE_DIR": str(tmp_path)}
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "last-serve.json").write_text(
        json.dumps({"frontend": "127.0.0.1:1", "http": "", "pid": int(gone.stdout)})
    )
    assert default_address(env) == DEFAULT_ADDR
    (tmp_path / "last-serve.json").write_text("not json")
    assert default_address(env) == DEFAULT_ADDR


def test_only_the_launcher_that_wrote_the_address_removes_it(tmp_path: Path) -> None:
    env = {"SPLITSERVE_CACHE_DIR": str(tmp_path)}
    path = tmp_path / "last-serve.json"
    path.write_text(json.dumps({"frontend": "127.0.0.1:2", "http": "", "pid": os.getppid()}))
    forget_serve(env)
    assert path.exists() and default_address(env) == "127.0.0.1:2"


def test_an_unwritable_cache_folder_is_an_os_error_the_launcher_can_survive(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"SPLITSERVE_CACHE_DIR": str(blocker / "cache")}
    with pytest.raises(OSError):
        record_serve("127.0.0.1:1", "", env)
    forget_serve(env)  # nothing to remove, nothing raised
    assert default_address(env) == DEFAULT_ADDR
