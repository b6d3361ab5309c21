"""Vocabulary-parallel token embedding and LM head.

Both split the (padded) vocabulary into equal contiguous row ranges, one per TP rank. The
embedding looks up the ids in its range, zeroes the others and all-reduces; the LM head
computes its slice of the logits, which `all_gather_logits` reassembles in vocabulary order.

Either may hold its table quantized (a `method` from `LinearMethods.vocab_method`: a GGUF
file's quantized token embedding, online int8): the embedding then dequantizes the rows it
looks up, the LM head runs the quantized kernels, and a tied LM head shares the embedding's
method (one copy of the table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import LinearMethodBase, linear, pack_weight
from worker_svc.layers.quant_pack import GroupQuantized
from worker_svc.layers.quant_source import Index, merge_rows, split_index, zero_rows
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
        method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.num_rows = padded_vocab_size(vocab_size, parallel.tp_size) // parallel.tp_size
        self.vocab_start = parallel.tp_rank * self.num_rows
        self.vocab_end = self.vocab_start + self.num_rows
        self.output_size_per_rank, self.input_size_per_rank = self.num_rows, hidden_size
        self.method = method
        if method is not None:
            method.create_weights(self, dtype, device)  # type: ignore[arg-type]
        else:
            self.weight = nn.Parameter(
                torch.zeros(self.num_rows, hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's table, in the compute dtype."""
        if self.method is None:
            return F.embedding(ids, self.weight)
        return self.method.embedding(self, ids).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.lookup(input_ids)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        embedded = self.lookup(local_ids)
        embedded.mul_(is_local.unsqueeze(-1).to(embedded.dtype))
        return self.parallel.all_reduce(embedded)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        num_valid = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        if self.method is not None:
            index = slice(self.vocab_start, self.vocab_end)
            padded = PaddedVocabulary(source, self.vocab_size)
            self.method.load_weight(self, padded, index, slice(0, self.num_rows))  # type: ignore[arg-type]
            return
        rows = read_rows(source, self.vocab_start, num_valid)
        copy_checked(self.weight.narrow(0, 0, num_valid), rows, param_name)


class PaddedVocabulary:
    """A quantized vocabulary table read past its last row: the padding rows are zeros."""

    def __init__(self, source: TensorSource, vocab_size: int) -> None:
        self.source = source
        self.vocab_size = vocab_size

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.source[index]

    def quantized(self, index: Index) -> GroupQuantized:
        rows, cols = split_index(index)
        start, stop = rows.start or 0, rows.stop
        quantized = getattr(self.source, "quantized", None)
        if quantized is None:
            raise ValueError("a quantized vocabulary table was given a float checkpoint tensor")
        valid = quantized((slice(start, min(stop, self.vocab_size)), cols))
        if stop <= self.vocab_size:
            return valid
        return merge_rows([valid, zero_rows(stop - max(start, self.vocab_size), valid)])


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: this rank's vocabulary slice of the logits."""

    packed: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.method.apply(self, hidden_states, None)  # type: ignore[arg-type]
        return linear(hidden_states, self.weight, self.packed, None)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's table (and its quantized method, if any)."""
        self.weight = embedding.weight
        self.method = embedding.method

    def pack(self, keep_dense: bool) -> None:
        """Use a packed copy of the weight; keep the dense one when the embedding shares it."""
        if self.method is not None:
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not keep_dense:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def all_gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every TP rank, padding columns cut off."""
        logits = self.parallel.all_gather(local_logits)
        return logits[..., : self.vocab_size]
