"""Stop strings: find the earliest stop string that touches newly generated text."""

from __future__ import annotations

from splitserve_contracts.sampling_types import SamplingParams


def stop_buffer_length(params: SamplingParams) -> int:
    """Characters held back while streaming so a partial stop string never leaks."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def find_stop_string(
    text: str, num_new_chars: int, stop: tuple[str, ...], include_stop_str: bool
) -> tuple[str, int] | None:
    """Search the part of `text` a stop string ending in the newest `num_new_chars` characters
    could occupy. Returns (matched stop string, length to keep) or None; the kept text ends at
    the stop string's end when `include_stop_str`, else at its start."""
    best: tuple[int, str] | None = None
    for candidate in stop:
        start = max(0, len(text) - num_new_chars - len(candidate) + 1)
        index = text.find(candidate, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, candidate)
    if best is None:
        return None
    index, matched = best
    return matched, index + len(matched) if include_stop_str else index
