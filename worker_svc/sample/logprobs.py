"""Log-probabilities of chosen tokens and the top alternatives, computed from raw logits.

Like vLLM's default (`raw_logprobs`), they come from the model's logits before penalties,
temperature and filters. A chosen token's rank counts the vocabulary tokens at least as likely
as it, so the most likely token has rank 1.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from splitserve_contracts.output_types import LogprobsTable


def compute_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [N, 1 + k], logprobs [N, 1 + k], ranks [N]) with the chosen token first."""
    chosen = chosen.view(-1, 1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_logprobs).sum(dim=1)
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=1)
        ids = torch.cat((chosen, top_ids), dim=1)
        values = torch.cat((chosen_logprobs, top_logprobs), dim=1)
    else:
        ids, values = chosen, chosen_logprobs
    return ids, values, ranks


def split_tables(
    ids: torch.Tensor,
    values: torch.Tensor,
    ranks: torch.Tensor,
    counts: list[int],
    num_tops: list[int],
) -> list[LogprobsTable]:
    """Cut batched results into per-request tables: `counts[i]` rows, `num_tops[i]` alternatives."""
    ids_np = ids.cpu().numpy().astype(np.int64)
    values_np = values.float().cpu().numpy()
    ranks_np = ranks.cpu().numpy().astype(np.int64)
    tables, start = [], 0
    for count, num_top in zip(counts, num_tops, strict=True):
        end = start + count
        tables.append(
            LogprobsTable(
                num_top,
                ids_np[start:end, : num_top + 1].reshape(-1).tolist(),
                values_np[start:end, : num_top + 1].reshape(-1).tolist(),
                ranks_np[start:end].tolist(),
            )
        )
        start = end
    return tables


def concat_tables(tables: list[LogprobsTable], num_top: int) -> LogprobsTable:
    """The rows of consecutive tables of one request (chunks of its prompt) as one table."""
    if len(tables) == 1:
        return tables[0]
    return LogprobsTable(
        num_top,
        list(chain.from_iterable(t.token_ids for t in tables)),
        list(chain.from_iterable(t.logprobs for t in tables)),
        list(chain.from_iterable(t.ranks for t in tables)),
    )
