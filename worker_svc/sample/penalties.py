"""Logit edits that run before sampling, each vectorized over the whole batch.

Order (vLLM's): allowed-token mask, min_tokens stop-token mask, logit_bias, then the
repetition, frequency and presence penalties. All edit float32 logits in place.
"""

from __future__ import annotations

import torch

from worker_svc.sample.sampling_metadata import PenaltyInputs, SamplingMetadata


def apply_logit_edits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply every edit `metadata` asks for to `logits` [N, V] (in place; also returned)."""
    if metadata.allowed_mask is not None:
        logits.masked_fill_(~metadata.allowed_mask, float("-inf"))
    if metadata.blocked is not None:
        rows, ids = metadata.blocked
        logits[rows, ids] = float("-inf")
    if metadata.logit_bias is not None:
        rows, ids, values = metadata.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if metadata.penalties is not None:
        apply_penalties(logits, metadata.penalties)
    return logits


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences [N, V] of each token id per row; ids == vocab_size are padding."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens)."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(penalties.output_token_ids, vocab_size)
    output_seen = output_counts > 0
    if penalties.prompt_token_ids is not None:
        seen = output_seen | (token_counts(penalties.prompt_token_ids, vocab_size) > 0)
        repetition = penalties.repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(penalties.frequency.unsqueeze(1) * output_counts)
    logits.sub_(penalties.presence.unsqueeze(1) * output_seen)
    return logits
