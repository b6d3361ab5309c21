"""Bidirectional attention over each request's whole prompt, without a KV cache (vLLM's
encoder-only attention, for BERT-style models).

Every query token of a request attends to every token of the same request, in both directions;
nothing is written to or read from the paged KV cache: the step's keys and values live only
in the forward pass, so a request keeps no KV after its step. That needs each request's whole
prompt in one step (the engine core never chunks an encoder-only model's prompts, and the
pooler refuses a step that carries part of one).

The step's requests are attended together: their tokens are scattered into a zero-padded
[requests, max_len] batch once per layer and `scaled_dot_product_attention` runs over it with a
key mask (True = a real token of the request); without padding (every request equally long)
the tokens are viewed as the batch directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.attention.backend import AttentionInputs


@dataclass(frozen=True, slots=True)
class EncoderAttentionMetadata:
    """Where each token of the step sits in the padded batch; built once per step."""

    num_reqs: int
    max_len: int
    token_index: torch.Tensor | None
    """[num_tokens] rows of the [num_reqs * max_len] batch; None without padding."""
    key_mask: torch.Tensor | None
    """[num_reqs, 1, 1, max_len] True for a request's real tokens; None without padding."""


def build_encoder_metadata(
    inputs: AttentionInputs, device: torch.device
) -> EncoderAttentionMetadata:
    """The step's padded batch layout: request i's tokens are its query span (its prompt)."""
    lens = inputs.query_lens
    num_reqs, max_len = len(lens), inputs.max_query_len
    if not num_reqs or (lens == max_len).all():
        return EncoderAttentionMetadata(num_reqs, max_len, None, None)
    starts = np.repeat(inputs.query_start_loc[:-1], lens)
    offsets = np.arange(inputs.num_tokens) - starts
    rows = np.repeat(np.arange(num_reqs, dtype=np.int64) * max_len, lens) + offsets
    is_key = np.arange(max_len)[None, :] < lens[:, None]
    return EncoderAttentionMetadata(
        num_reqs,
        max_len,
        torch.from_numpy(rows).to(device),
        torch.from_numpy(is_key).to(device)[:, None, None, :],
    )


def encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: EncoderAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend query/key/value [tokens, heads, head_dim] within each request -> [tokens, heads,
    head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    shape = (metadata.num_reqs, metadata.max_len, num_heads, head_dim)
    index = metadata.token_index

    def batch(x: torch.Tensor) -> torch.Tensor:
        if index is not None:
            padded = x.new_zeros(shape[0] * shape[1], num_heads, head_dim)
            x = padded.index_copy_(0, index, x)
        return x.reshape(shape).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        batch(query), batch(key), batch(value), attn_mask=metadata.key_mask, scale=scale
    )
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out if index is None else out[index]
