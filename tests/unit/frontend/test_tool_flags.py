"""The frontend's tool and reasoning flags refuse what cannot work at start-up, as a user sees
it from the real command: an unknown parser exits 2 naming the choices, auto tool choice
without a parser exits 2, and a reasoning parser whose think tokens the tokenizer lacks stops
the frontend (before it connects to the engine core) naming the missing tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend_svc.openai.reasoning import REASONING_PARSERS
from frontend_svc.openai.tool_parsers import TOOL_PARSERS


def _frontend(*flags: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITSERVE_LOG_LEVEL": "warning"}
    return subprocess.run(
        [sys.executable, "-m", "frontend_svc", *flags],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "choices"),
    [("--tool-call-parser", TOOL_PARSERS), ("--reasoning-parser", REASONING_PARSERS)],
)
def test_unknown_parsers_exit_2_naming_the_choices(flag: str, choices: dict[str, object]) -> None:
    done = _frontend("--model", "tiny", flag, "nope")
    assert done.returncode == 2, done.stderr
    assert "nope" in done.stderr and all(name in done.stderr for name in choices)


def test_auto_tool_choice_needs_a_parser() -> None:
    done = _frontend("--model", "tiny", "--enable-auto-tool-choice")
    assert done.returncode == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in done.stderr
    assert "hermes" in done.stderr


def test_a_reasoning_parser_needs_its_think_tokens(tiny_model_dir: Path) -> None:
    done = _frontend(
        "--model", str(tiny_model_dir), "--reasoning-parser", "deepseek_r1",
        "--core-addr", "127.0.0.1:1", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
    )  # fmt: skip
    assert done.returncode == 1
    assert "--reasoning-parser deepseek_r1 needs the tokens <think> and </think>" in done.stderr
