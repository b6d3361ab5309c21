"""Encoder outputs by content hash, on one rank (vLLM's encoder_cache in the model runner).

The engine core decides what the cache holds: an entry is made when a step schedules the
item's encoder and dropped when the core lists its hash in free_encoder_mm_hashes (no request
needs it and its room was wanted). Entries are shared by every request with the same image.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EncoderCache:
    """Content hash -> embeddings [num_tokens, hidden] of one multimodal item."""

    def __init__(self) -> None:
        self.entries: dict[str, torch.Tensor] = {}
        self.num_encoded = 0
        """Items this rank ran the encoder for, cumulative."""

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, identifier: str) -> torch.Tensor | None:
        return self.entries.get(identifier)

    def put(self, identifier: str, embeddings: torch.Tensor) -> None:
        self.entries[identifier] = embeddings
        self.num_encoded += 1

    def free(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self.entries.pop(identifier, None)

    def clear(self) -> None:
        self.entries.clear()
