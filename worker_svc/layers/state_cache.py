"""The state layers' seam (vLLM's MambaBase + mamba metadata): what a layer that keeps a
fixed-size state per request (Mamba2, gated DeltaNet) declares and reads each step.

A state layer declares its per-request state as a `StateSpec` (one tensor per shape, e.g. the
convolution's last inputs and the SSM state); the rank's state cache holds, per state layer, one
tensor per shape of `num_slots` rows, `[num_slots, *shape]`, and passes that tuple to the layer
where an attention layer gets its paged KV tensor. Slot 0 is the null slot (never a request's).
The engine core gives each request one slot, for its whole life on the rank (the state group of
the core's KV cache manager); a slot is zeroed when it is given to a request, so a request's
first chunk starts from a zero state.

Each step the layer gets a `StateMetadata` in its StepContext (`ctx.state`): the requests in the
step's token order, their token runs and slots, and how many tokens each had computed before.
A layer reads slot `slots[i]` as request i's state before its run
`query_start_loc[i]:query_start_loc[i + 1]` and writes the state after the run back into it, so a
prompt cut into chunks gives the same outputs as the whole prompt, or token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LayerCache = torch.Tensor | tuple[torch.Tensor, ...]
"""What a layer gets as its cache: an attention layer its paged KV tensor, a state layer the
tuple of its state tensors."""


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One state layer's state per request: a tensor of each shape (this rank's part), in dtype."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(math.prod(shape) for shape in self.shapes) * element_size


@dataclass(frozen=True, slots=True)
class StateMetadata:
    """The step's requests as the state layers see them, in the step's token order.

    `query_start_loc[i]:query_start_loc[i + 1]` are request i's tokens in the flattened step;
    `context_lens[i]` its tokens computed before this step (0: its state is the zero state);
    `slots[i]` (`slot_list[i]` on the host) its state slot. `decode_rows` are the requests with
    exactly one token (the batched recurrent step), `prefill_rows` the others, both ascending;
    for the decode rows, built once a step for every state layer: their tokens' indices in the
    step (`decode_tokens`), their slots (`decode_slots`) and whether each starts from the zero
    state (`decode_fresh`).
    """

    query_start_loc: list[int]
    context_lens: list[int]
    slot_list: list[int]
    slots: torch.Tensor
    decode_rows: list[int]
    prefill_rows: list[int]
    decode_tokens: torch.Tensor
    decode_slots: torch.Tensor
    decode_fresh: torch.Tensor

    @classmethod
    def of(
        cls, query_start_loc: list[int], context_lens: list[int], slots: list[int],
        device: torch.device,
    ) -> StateMetadata:  # fmt: skip
        lengths = [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]
        decode_rows = [i for i, n in enumerate(lengths) if n == 1]
        return cls(
            query_start_loc,
            context_lens,
            slots,
            torch.tensor(slots, dtype=torch.int64, device=device),
            decode_rows,
            [i for i, n in enumerate(lengths) if n != 1],
            torch.tensor(
                [query_start_loc[i] for i in decode_rows], dtype=torch.int64, device=device
            ),
            torch.tensor([slots[i] for i in decode_rows], dtype=torch.int64, device=device),
            torch.tensor(
                [context_lens[i] == 0 for i in decode_rows], dtype=torch.bool, device=device
            ),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.slot_list)
