"""Vocabulary-parallel token embedding and LM head.

Both split the (padded) vocabulary into equal contiguous row ranges, one per TP rank. The
embedding looks up the ids in its range, zeroes the others and all-reduces; the LM head
computes its slice of the logits, which `all_gather_logits` reassembles in vocabulary order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import linear, pack_weight
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_rows

VOCAB_PADDING = 64


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PADDING * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of the embedding table live on this rank.

    Invariant: padding rows (ids >= vocab_size) are zero and never looked up.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.num_rows = padded_vocab_size(vocab_size, parallel.tp_size) // parallel.tp_size
        self.vocab_start = parallel.tp_rank * self.num_rows
        self.vocab_end = self.vocab_start + self.num_rows
        self.weight = nn.Parameter(
            torch.zeros(self.num_rows, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        embedded = F.embedding(local_ids, self.weight)
        embedded.mul_(is_local.unsqueeze(-1).to(embedded.dtype))
        return self.parallel.all_reduce(embedded)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        num_valid = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        rows = read_rows(source, self.vocab_start, num_valid)
        copy_checked(self.weight.narrow(0, 0, num_valid), rows, param_name)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: this rank's vocabulary slice of the logits."""

    packed: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight, self.packed, None)

    def pack(self, keep_dense: bool) -> None:
        """Use a packed copy of the weight; keep the dense one when the embedding shares it."""
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not keep_dense:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def all_gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every TP rank, padding columns cut off."""
        logits = self.parallel.all_gather(local_logits)
        return logits[..., : self.vocab_size]
