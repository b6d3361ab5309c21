"""The rank's torch profiler (vLLM's --profiler-config, /start_profile and /stop_profile): started
and stopped by the engine core between two steps, on the thread that runs the steps (torch's
profiler must start, run and stop on the thread whose ops it records). Traces go to the
configured folder, one per rank and session, named `<prefix>rank<r>...pt.trace.json[.gz]` by
torch's tensorboard_trace_handler, as vLLM's workers name theirs.
"""

from __future__ import annotations

import logging

import torch

from splitserve_runtime.profiler_config import ProfilerConfig, check_profile_prefix

logger = logging.getLogger(__name__)
START, STOP = 1, 2
"""ProfileAction's numbers."""


class RankProfiler:
    """Starts and stops one rank's torch profiler; commands that make no sense are logged and
    dropped (a stop without a start, a start while running, profiling not configured)."""

    def __init__(self, config: ProfilerConfig, rank: int, device: torch.device) -> None:
        self.config, self.rank, self.device = config, rank, device
        self._running: torch.profiler.profile | None = None

    def apply(self, action: int, prefix: str) -> None:
        if not self.config.is_enabled:
            logger.warning("profile command ignored: this rank runs without --profiler-config")
            return
        try:
            prefix = check_profile_prefix(prefix)
        except ValueError as err:
            logger.warning("profile command ignored: %s", err)
            return
        if action == START and self._running is None:
            self._running = self._profile(prefix)
            self._running.start()
            logger.info("torch profiler started on rank %d", self.rank)
        elif action == STOP and self._running is not None:
            running, self._running = self._running, None
            running.stop()  # writes the trace (tensorboard_trace_handler)
            logger.info(
                "torch profiler stopped on rank %d; trace in %s",
                self.rank,
                self.config.torch_profiler_dir,
            )
        else:
            logger.warning("profile command %d ignored (profiler %s)", action,
                           "running" if self._running else "not running")  # fmt: skip

    def _profile(self, prefix: str) -> torch.profiler.profile:
        config = self.config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        name = f"{prefix}{'_' if prefix else ''}rank{self.rank}"
        return torch.profiler.profile(
            activities=activities,
            record_shapes=config.record_shapes,
            profile_memory=config.with_memory,
            with_stack=config.with_stack,
            with_flops=config.with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                config.torch_profiler_dir, worker_name=name, use_gzip=config.use_gzip
            ),
        )
