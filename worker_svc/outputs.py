"""What a rank returns for one step (the worker's side of the protobuf ModelRunnerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class LogprobsTable:
    """Log-probabilities of consecutive positions of one request.

    Row i holds the chosen (sampled or given) token in column 0, then the
    `num_top_logprobs` most likely tokens, most likely first. `ranks[i]` is the chosen
    token's 1-based rank among the whole vocabulary.
    """

    num_top_logprobs: int
    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    ranks: npt.NDArray[np.int64]

    @property
    def num_positions(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def concat(tables: list[LogprobsTable], num_top_logprobs: int) -> LogprobsTable:
        if not tables:
            width = num_top_logprobs + 1
            return LogprobsTable(
                num_top_logprobs,
                np.zeros((0, width), dtype=np.int64),
                np.zeros((0, width), dtype=np.float32),
                np.zeros(0, dtype=np.int64),
            )
        return LogprobsTable(
            num_top_logprobs,
            np.concatenate([t.token_ids for t in tables]),
            np.concatenate([t.logprobs for t in tables]),
            np.concatenate([t.ranks for t in tables]),
        )


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Where one step's time went on this rank, in seconds of the rank's own clock."""

    prepare_inputs_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """One step's result on the output rank.

    `req_handles[i]` sampled `sampled_token_ids[i]`; requests whose prefill chunk did not
    finish the prompt are absent. An `error_message` marks a failed step.
    """

    step_id: int
    rank: int
    req_handles: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    sampled_token_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    logprobs: dict[int, LogprobsTable] = field(default_factory=dict)
    prompt_logprobs: dict[int, LogprobsTable] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)
    num_used_kv_blocks: int = 0
    failed_reqs: dict[int, str] = field(default_factory=dict)
    """Requests this step refused for their own invalid data, and why."""
    error_message: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error_message is None
