"""Per-request sampling settings kept on the worker, and the per-step batch the sampler reads.

`SamplingStates` stores each request's settings as columns indexed by its input-batch row, so a
step gathers them for the sampled rows with a few numpy fancy-index operations. The rare
sparse settings (logit_bias, allowed_token_ids, stop ids under min_tokens) live in dicts and
are flattened into (row, token) index arrays only when some sampled row uses them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import GREEDY_TEMPERATURE
from splitserve_contracts.sampling_types import SamplerParams

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
NO_LOGPROBS = -1


@dataclass(frozen=True, slots=True)
class PenaltyInputs:
    """Penalty weights [N] and the tokens they count, padded with `vocab_size` (a dump column)."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_token_ids: torch.Tensor  # [N, max_outputs]
    prompt_token_ids: torch.Tensor | None  # [N, max_prompt]; None without repetition penalty


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Everything the sampler needs for the N rows of the step's logits, in logits order."""

    temperature: torch.Tensor  # [N] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [N] int64; vocab_size where disabled
    top_p: torch.Tensor | None = None  # [N] float32
    min_p: torch.Tensor | None = None  # [N] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> own generator
    penalties: PenaltyInputs | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    allowed_mask: torch.Tensor | None = None  # [N, V] bool, True = may be sampled
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids masked by min_tokens
    num_logprobs: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def max_num_logprobs(self) -> int | None:
        """Most alternatives any row asked for; None when no row wants logprobs."""
        if self.num_logprobs.size == 0 or self.num_logprobs.max() < 0:
            return None
        return int(self.num_logprobs.max())

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer."""
        return (
            self.all_greedy
            and self.penalties is None
            and self.logit_bias is None
            and self.allowed_mask is None
            and self.blocked is None
            and self.max_num_logprobs is None
        )


class SamplingStates:
    """Sampling settings of every live request, by input-batch row."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.limits = sampling_rules.Limits(vocab_size=vocab_size, max_logprobs=vocab_size)
        self.device = device
        self.generators: dict[int, torch.Generator] = {}
        self.logit_bias: dict[int, tuple[IntArray, npt.NDArray[np.float32]]] = {}
        self.allowed_token_ids: dict[int, IntArray] = {}
        self.stop_token_ids: dict[int, IntArray] = {}
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.temperature = np.zeros(capacity, np.float32)
        self.top_p = np.ones(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int64)
        self.min_p = np.zeros(capacity, np.float32)
        self.presence = np.zeros(capacity, np.float32)
        self.frequency = np.zeros(capacity, np.float32)
        self.repetition = np.ones(capacity, np.float32)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.num_logprobs = np.full(capacity, NO_LOGPROBS, np.int64)
        self.num_prompt_logprobs = np.full(capacity, NO_LOGPROBS, np.int64)

    def grow(self, capacity: int) -> None:
        old = {name: getattr(self, name) for name in _COLUMNS}
        self._allocate(capacity)
        for name, values in old.items():
            getattr(self, name)[: len(values)] = values

    def add(
        self,
        row: int,
        params: SamplerParams,
        stop_token_ids: IntArray,
        min_tokens: int,
        num_output_tokens: int = 0,
    ) -> None:
        """Store a new request's settings (checked by the caller with sampling_rules against
        `limits`). A request resumed with `num_output_tokens` outputs already generated sends
        no prompt logprobs again, and its seeded generator skips the draws they used."""
        greedy = sampling_rules.is_greedy(params)
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.top_k[row] = 0 if greedy or params.top_k < 0 else min(params.top_k, self.vocab_size)
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.min_tokens[row] = min_tokens
        self.num_logprobs[row] = self._num_logprobs(params.logprobs)
        self.num_prompt_logprobs[row] = self._num_logprobs(params.prompt_logprobs)
        if num_output_tokens:
            self.num_prompt_logprobs[row] = NO_LOGPROBS  # sent before the request resumed
        if params.seed is not None and not greedy:
            generator = torch.Generator(self.device).manual_seed(params.seed)
            skip_draws(generator, num_output_tokens, self.vocab_size, self.device)
            self.generators[row] = generator
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
            values = np.fromiter(params.logit_bias.values(), np.float32, len(ids))
            limit = sampling_rules.LOGIT_BIAS_LIMIT
            self.logit_bias[row] = (ids, np.clip(values, -limit, limit))
        if params.allowed_token_ids:
            self.allowed_token_ids[row] = np.asarray(params.allowed_token_ids, np.int64)
        if min_tokens > 0 and stop_token_ids.size:
            self.stop_token_ids[row] = stop_token_ids

    def resync_generator(self, row: int, num_output_tokens: int) -> None:
        """A preempted request resumes with `num_output_tokens` outputs: its seeded generator
        restarts past their draws (under async scheduling it may also have drawn for a token
        the engine core dropped with the step in flight)."""
        generator = self.generators.get(row)
        if generator is not None:
            fresh = torch.Generator(self.device).manual_seed(generator.initial_seed())
            skip_draws(fresh, num_output_tokens, self.vocab_size, self.device)
            self.generators[row] = fresh

    def _num_logprobs(self, requested: int | None) -> int:
        return NO_LOGPROBS if requested is None else requested

    def remove(self, row: int) -> None:
        for sparse in (
            self.generators,
            self.logit_bias,
            self.allowed_token_ids,
            self.stop_token_ids,
        ):
            sparse.pop(row, None)

    def wants_prompt_logprobs(self, row: int) -> bool:
        return bool(self.num_prompt_logprobs[row] >= 0)

    def build(
        self,
        rows: IntArray,
        token_ids: npt.NDArray[np.int32],
        num_prompt_tokens: IntArray,
        num_tokens: IntArray,
    ) -> SamplingMetadata:
        """Metadata for sampling `rows` (one logits row each, in order; a row may repeat, one
        entry per draft position of a request that verifies drafts). `num_prompt_tokens` and
        `num_tokens` are per entry of `rows`: the tokens before the sampled one (a draft
        position's count includes the drafts before it, which token_ids holds after the
        request's tokens), so penalties and min_tokens see what precedes each position."""
        temperature = self.temperature[rows]
        is_greedy = temperature < GREEDY_TEMPERATURE
        num_outputs = num_tokens - num_prompt_tokens
        top_k = self.top_k[rows]
        top_p, min_p = self.top_p[rows], self.min_p[rows]
        to = self._tensor
        return SamplingMetadata(
            temperature=to(temperature),
            all_greedy=bool(is_greedy.all()),
            all_random=not bool(is_greedy.any()),
            top_k=to(np.where(top_k > 0, top_k, self.vocab_size)) if top_k.any() else None,
            top_p=to(top_p) if (top_p < 1.0).any() else None,
            min_p=to(min_p) if (min_p > 0.0).any() else None,
            generators={
                i: self.generators[r] for i, r in enumerate(rows.tolist()) if r in self.generators
            },
            penalties=self._penalties(rows, token_ids, num_prompt_tokens, num_tokens),
            logit_bias=self._logit_bias(rows),
            allowed_mask=self._allowed_mask(rows),
            blocked=self._blocked(rows, num_outputs),
            num_logprobs=self.num_logprobs[rows],
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    def _penalties(
        self,
        rows: IntArray,
        token_ids: npt.NDArray[np.int32],
        num_prompt_tokens: IntArray,
        num_tokens: IntArray,
    ) -> PenaltyInputs | None:
        presence, frequency = self.presence[rows], self.frequency[rows]
        repetition = self.repetition[rows]
        has_repetition = bool((repetition != 1.0).any())
        if not (presence.any() or frequency.any() or has_repetition):
            return None
        starts, ends = num_prompt_tokens, num_tokens
        outputs = _ragged_take(token_ids, rows, starts, ends, self.vocab_size)
        prompts = None
        if has_repetition:
            prompts = self._tensor(
                _ragged_take(token_ids, rows, 0 * starts, starts, self.vocab_size)
            )
        return PenaltyInputs(
            self._tensor(presence),
            self._tensor(frequency),
            self._tensor(repetition),
            self._tensor(outputs),
            prompts,
        )

    def _flatten(
        self, rows: IntArray, sparse: dict[int, IntArray], keep: npt.NDArray[np.bool_] | None = None
    ) -> tuple[IntArray, IntArray] | None:
        hits = [(i, sparse[r]) for i, r in enumerate(rows.tolist()) if r in sparse]
        if keep is not None:
            hits = [(i, ids) for i, ids in hits if keep[i]]
        if not hits:
            return None
        index = np.concatenate([np.full(len(ids), i, np.int64) for i, ids in hits])
        return index, np.concatenate([ids for _, ids in hits])

    def _logit_bias(self, rows: IntArray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.logit_bias:
            return None
        ids_only = {r: ids for r, (ids, _) in self.logit_bias.items()}
        flat = self._flatten(rows, ids_only)
        if flat is None:
            return None
        values = [self.logit_bias[r][1] for r in rows.tolist() if r in self.logit_bias]
        return self._tensor(flat[0]), self._tensor(flat[1]), self._tensor(np.concatenate(values))

    def _allowed_mask(self, rows: IntArray) -> torch.Tensor | None:
        flat = self._flatten(rows, self.allowed_token_ids) if self.allowed_token_ids else None
        if flat is None:
            return None
        is_restricted = np.isin(rows, list(self.allowed_token_ids))
        mask = torch.from_numpy(np.repeat(~is_restricted[:, None], self.vocab_size, axis=1))
        mask[torch.from_numpy(flat[0]), torch.from_numpy(flat[1])] = True
        return mask.to(self.device)

    def _blocked(
        self, rows: IntArray, num_outputs: IntArray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.stop_token_ids:
            return None
        flat = self._flatten(rows, self.stop_token_ids, keep=num_outputs < self.min_tokens[rows])
        return None if flat is None else (self._tensor(flat[0]), self._tensor(flat[1]))


def skip_draws(
    generator: torch.Generator, num_tokens: int, vocab_size: int, device: torch.device
) -> None:
    """Advance a request's generator past the draws of `num_tokens` sampled tokens: the sampler
    draws one Exp(1) row of `vocab_size` float32 values per token (sampler.py), so drawing the
    same rows here leaves the generator where the request left it."""
    if num_tokens:
        row = torch.empty(vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_tokens):
            row.exponential_(generator=generator)


_COLUMNS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence",
    "frequency",
    "repetition",
    "min_tokens",
    "num_logprobs",
    "num_prompt_logprobs",
)


def _ragged_take(
    table: npt.NDArray[np.int32], rows: IntArray, starts: IntArray, ends: IntArray, pad: int
) -> IntArray:
    """table[rows[i], starts[i]:ends[i]] for every i, right-padded with `pad` to one width."""
    lengths = ends - starts
    width = max(int(lengths.max(initial=0)), 1)
    cols = starts[:, None] + np.arange(width)[None, :]
    valid = cols < ends[:, None]
    taken = table[rows[:, None], np.minimum(cols, table.shape[1] - 1)].astype(np.int64)
    return np.where(valid, taken, pad)
