"""The batched sampler: logit edits, greedy or random choice, log-probabilities.

Order, after vLLM's: (1) logprobs from the raw logits when asked (--logprobs-mode raw_*);
(2) allowed ids, min_tokens, logit_bias, penalties (`penalties.py`); (3) greedy rows take the
argmax; random rows divide by their temperature, apply min_p, then top-k / top-p (these edit the
logits in place, so processed_* logprobs are taken from them afterwards), and draw with the
exponential race
`argmax(probs / q)`, q ~ Exp(1). A request with a seed draws its q from its own generator, so
it samples the same tokens whatever else shares the batch; the others share the engine's
generator, seeded identically on every tensor-parallel rank, so all ranks pick the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve_contracts.engine_options_types import ModelOptions
from worker_svc.sample.logprobs import compute_logprobs
from worker_svc.sample.penalties import apply_logit_edits
from worker_svc.sample.sampling_metadata import SamplingMetadata


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Chosen token per row [N], and (ids, logprobs, ranks) when some row asked for logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k tokens, then its smallest set with probability mass >= top_p."""
    if top_p is None:
        if top_k is None:
            return logits
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth, float("-inf"))
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (ascending.shape[1] - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    ascending.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, ascending)


class Sampler:
    """Samples one token per logits row; see the module docstring for the order of operations."""

    def __init__(self, device: torch.device, options: ModelOptions) -> None:
        self.options = options
        """The engine's model options (--seed seeds the engine's generator)."""
        self.generator = torch.Generator(device).manual_seed(options.seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` [N, V] float32 is edited in place."""
        if metadata.is_plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1))
        max_num_logprobs = metadata.max_num_logprobs
        mode = self.options.logprobs_mode
        table = None
        if max_num_logprobs is not None and mode.startswith("raw_"):
            table = logits.clone() if mode == "raw_logits" else torch.log_softmax(logits, dim=-1)
        apply_logit_edits(logits, metadata)
        sampled = self._sample(logits, metadata)
        if max_num_logprobs is None:
            return SamplerOutput(sampled)
        if table is None:  # processed_*: the logits as edited in place
            table = logits if mode == "processed_logits" else torch.log_softmax(logits, dim=-1)
        return SamplerOutput(sampled, compute_logprobs(table, sampled, max_num_logprobs))

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        is_greedy = metadata.temperature == 0.0
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits.div_(temperature.unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        sampled = probs.div_(self._exponential_noise(probs, metadata, is_greedy)).argmax(dim=-1)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)

    def _exponential_noise(
        self, probs: torch.Tensor, metadata: SamplingMetadata, is_greedy: torch.Tensor
    ) -> torch.Tensor:
        """q ~ Exp(1) per (row, token): seeded rows from their own generator, random rows from
        the engine's, greedy rows not at all (their q is 1 and their choice is discarded)."""
        noise = torch.empty_like(probs)
        if not metadata.generators and metadata.all_random:
            return noise.exponential_(generator=self.generator)
        uses_default = ~is_greedy.cpu().numpy()
        uses_default[list(metadata.generators)] = False
        noise.fill_(1.0)
        default_rows = torch.from_numpy(np.flatnonzero(uses_default)).to(probs.device)
        if default_rows.numel():
            drawn = torch.empty(
                (default_rows.numel(), probs.shape[1]), dtype=probs.dtype, device=probs.device
            )
            noise[default_rows] = drawn.exponential_(generator=self.generator)
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        return noise
