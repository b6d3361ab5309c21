"""vLLM's `--profiler-config` (vLLM 0.32's ProfilerConfig, as JSON): which profiler `/start_profile`
and `/stop_profile` drive and where the traces go. Only the torch profiler is offered (it runs on
every worker rank); without the flag those routes do not exist, as in vLLM. The frontend, the
engine core and the workers all take the flag (`splitserve serve` passes it to each): the
frontend serves the routes, the core relays them between two steps, the ranks profile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass

from splitserve_runtime.flags import Flag, flag

TORCH_OPTIONS = {
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
}
"""vLLM's torch profiler switches and their defaults."""
ACCEPTED = {"profiler", "torch_profiler_dir", "ignore_frontend", *TORCH_OPTIONS}
PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ProfilerConfig:
    """The torch profiler's settings (profiler is None: no profiling routes)."""

    profiler: str | None = None
    torch_profiler_dir: str = ""
    with_stack: bool = True
    with_flops: bool = False
    use_gzip: bool = True
    record_shapes: bool = False
    with_memory: bool = False

    @property
    def is_enabled(self) -> bool:
        return self.profiler == "torch"


def parse_profiler_config(text: str) -> ProfilerConfig:
    """argparse type of --profiler-config: a JSON object of vLLM's ProfilerConfig fields."""
    try:
        value = json.loads(text) if text else {}
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('expected a JSON object, e.g. {"profiler": "torch", ...}')
    unknown = sorted(set(value) - ACCEPTED)
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not available here")
    profiler = value.get("profiler")
    if profiler not in (None, "torch"):
        raise argparse.ArgumentTypeError(
            f"profiler {profiler!r} is not available here: only the torch profiler"
        )
    folder = value.get("torch_profiler_dir", "")
    if not isinstance(folder, str) or (profiler == "torch") != bool(folder):
        raise argparse.ArgumentTypeError(
            "torch_profiler_dir (a folder) is needed with, and only with, profiler torch"
        )
    switches = {name: value.get(name, default) for name, default in TORCH_OPTIONS.items()}
    if not all(isinstance(v, bool) for v in switches.values()):
        raise argparse.ArgumentTypeError("the torch_profiler_* switches are true or false")
    return ProfilerConfig(
        profiler,
        os.path.abspath(os.path.expanduser(folder)) if folder else "",
        *(switches[name] for name in TORCH_OPTIONS),
    )


def check_profile_prefix(prefix: str) -> str:
    """vLLM's profile_prefix rule; ValueError naming it otherwise ("" is none)."""
    if prefix and not PREFIX.match(prefix):
        raise ValueError(
            "profile_prefix must be 1-128 ASCII characters, start with a letter or number, "
            "and contain only letters, numbers, '.', '_', or '-'"
        )
    return prefix


PROFILER_FLAGS: tuple[Flag, ...] = (
    flag(
        "--profiler-config",
        type=parse_profiler_config,
        default=ProfilerConfig(),
        help='vLLM\'s profiler config as JSON: {"profiler": "torch", "torch_profiler_dir": '
        '"/tmp/traces"} adds POST /start_profile and /stop_profile, which run the torch '
        "profiler on every worker rank (traces per rank in that folder on the ranks' hosts) "
        "(default: none, no profiling routes)",
    ),
)
