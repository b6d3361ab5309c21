"""An adapter's safetensors header, checked against the file's size before safetensors opens it.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor to
its dtype, shape and `data_offsets` [begin, end) into the data after the header, then the data.
safetensors itself refuses a header that does not fit its file (without reading or allocating),
but in words that name neither the tensor nor the sizes ("incomplete metadata, file not fully
covered"); this check says which tensor claims bytes the file does not have, as the client's
one-line reason. What it does not check (dtype and shape against the offsets, gaps) safetensors
still does when it opens the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from worker_svc.lora.peft_config import AdapterError

LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on the JSON header."""
MAX_NAME_CHARS = 200
"""Of a tensor name quoted in a refusal."""


def check_safetensors_header(path: Path) -> None:
    """AdapterError, naming the file, when its header claims more bytes than the file holds."""
    name, size = path.name, path.stat().st_size
    with path.open("rb") as f:
        head = f.read(LENGTH_BYTES)
        if len(head) < LENGTH_BYTES:
            raise AdapterError(
                f"{name}: the file has {size} bytes, too few for a safetensors header "
                "(truncated or not a safetensors file)"
            )
        (length,) = struct.unpack("<Q", head)
        if length > size - LENGTH_BYTES:
            raise AdapterError(
                f"{name}: the header says it is {length} bytes long but the file has {size} "
                "bytes (truncated or not a safetensors file)"
            )
        if length > MAX_HEADER_BYTES:
            raise AdapterError(
                f"{name}: the header is {length} bytes long, more than safetensors allows "
                f"({MAX_HEADER_BYTES})"
            )
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            raise AdapterError(f"{name}: the header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{name}: the header is not a JSON object")
    num_data_bytes = size - LENGTH_BYTES - length
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        begin, end = _offsets(name, tensor, entry)
        if end > num_data_bytes:
            raise AdapterError(
                f"{name}: the header says tensor {tensor[:MAX_NAME_CHARS]!r} needs bytes {begin}..{end} of the "
                f"data, but the file holds {num_data_bytes} bytes of data (truncated or corrupt)"
            )


def _offsets(name: str, tensor: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise AdapterError(
            f"{name}: the header gives tensor {tensor[:MAX_NAME_CHARS]!r} no valid data_offsets "
            f"(got {str(offsets)[:80]})"
        )
    return offsets[0], offsets[1]
