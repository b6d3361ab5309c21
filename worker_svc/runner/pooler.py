"""Pooling a prompt's final hidden states into one vector (vLLM's Pooler), across prefill chunks.

A prompt may run over several steps (chunked prefill), so MEAN keeps a running float32 sum and
CLS the first token's state per request until the step that completes the prompt; LAST needs
only that step. A chunk that starts at position 0 starts the request afresh (a recompute after
a preemption drops what the earlier run pooled). Then, as the checkpoint says, the vector is
L2-normalized; a Matryoshka truncation (`dimensions`) is the frontend's (it re-normalizes).
An encoder-only model's prompt must come whole, in one step (its attention is bidirectional): a
step carrying part of one fails that request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from splitserve_contracts.output_types import PoolerConfig, PoolerOutput
from worker_svc.runner.step_inputs import StepInputs

_PART_OF_A_PROMPT = (
    "an encoder-only model computes a prompt whole, in one step; the step carried part of one"
)


class Pooler:
    """Pools one rank's steps; every request it sees is a pooling request."""

    def __init__(
        self, config: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.config = config
        self.head = head
        """A classifier's head (the model's pool_head): pooled states -> label scores."""
        self._partial: dict[int, torch.Tensor] = {}
        """Requests part-way through their prompt: their running sum (MEAN) or first token's
        state (CLS)."""

    def forget(self, handles: Iterable[int]) -> None:
        for handle in handles:
            self._partial.pop(handle, None)

    def pool(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[list[PoolerOutput], dict[int, str]]:
        """The vectors of the requests whose prompt completes this step, and the requests it
        cannot pool (a chunk continuing a prompt this rank has no state for), with why."""
        qsl = inputs.query_start_loc
        num_reqs = len(qsl) - 1
        is_done = np.zeros(num_reqs, dtype=bool)
        is_done[inputs.sampling_reqs] = True
        starts = inputs.positions[qsl[:-1]] if num_reqs else qsl[:0]
        failed: dict[int, str] = {}
        if self.config.is_encoder_only:
            for i in np.flatnonzero((starts > 0) | ~is_done).tolist():
                failed[int(inputs.req_handles[i])] = _PART_OF_A_PROMPT
            is_done &= starts == 0
        pooling_type = self.config.pooling_type
        if pooling_type == "LAST":
            done = np.flatnonzero(is_done)
            last = torch.from_numpy(qsl[1:][done] - 1).to(hidden.device)
            vectors = list(hidden[last].float())
            return self._finish(inputs.req_handles[done].tolist(), vectors), failed
        chunk = self._chunk_states(hidden, qsl)
        handles: list[int] = []
        vectors = []
        for i, handle in enumerate(inputs.req_handles.tolist()):
            if handle in failed:
                continue
            state = chunk[i]
            earlier = self._partial.pop(handle, None)  # dropped when the prompt starts again
            if starts[i] > 0:
                if earlier is None:
                    failed[handle] = "a prompt chunk came without the chunks before it"
                    continue
                state = earlier + state if pooling_type == "MEAN" else earlier
            if not is_done[i]:
                self._partial[handle] = state
                continue
            handles.append(handle)
            vectors.append(state / float(inputs.seq_lens[i]) if pooling_type == "MEAN" else state)
        return self._finish(handles, vectors), failed

    def _chunk_states(self, hidden: torch.Tensor, qsl: np.ndarray) -> torch.Tensor:
        """Per request of the step: its chunk's float32 sum (MEAN) or first token's state."""
        if self.config.pooling_type == "CLS":
            return hidden[torch.from_numpy(qsl[:-1]).to(hidden.device)].float()
        counts = torch.from_numpy(np.diff(qsl)).to(hidden.device)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), counts)
        sums = torch.zeros(len(counts), hidden.shape[-1], device=hidden.device)
        return sums.index_add_(0, owner, hidden.float())

    def _finish(self, handles: list[int], vectors: list[torch.Tensor]) -> list[PoolerOutput]:
        if not handles:
            return []
        stacked = torch.stack(vectors)
        if self.head is not None:
            stacked = self.head(stacked)
        if self.config.normalize:
            stacked = F.normalize(stacked, p=2.0, dim=-1)
        rows = stacked.cpu().numpy().astype("<f4")
        return [PoolerOutput(h, row.tobytes()) for h, row in zip(handles, rows, strict=True)]
