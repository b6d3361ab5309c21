"""ChunkWriter: checks each chunk a producer sends before it writes it (never trust the peer):
layer by layer, blocks in order, the exact bytes of its blocks, nothing past the load."""

from __future__ import annotations

from collections.abc import Sequence

from worker_svc.kv_connector.block_io import BlockIO


class LoadFailed(Exception):  # noqa: N818 (a reason for failed_recving)
    """Why a load failed, as failed_recving reports it."""


class ChunkWriter:
    """Writes one load's chunks into `local_block_ids` (checked in range by the caller)."""

    def __init__(self, blocks: BlockIO, local_block_ids: Sequence[int]) -> None:
        self.blocks = blocks
        self.local_block_ids = list(local_block_ids)
        self.layer = 0
        self.next_block = 0
        self.num_bytes = 0

    def write(
        self, layer: int, first_block: int, num_blocks: int, data: bytes | memoryview
    ) -> None:
        """Write one chunk; LoadFailed (nothing written) when it is not the expected next one."""
        total = len(self.local_block_ids)
        if self.next_block == total and first_block == 0 and layer == self.layer + 1:
            self.layer, self.next_block = layer, 0  # the next layer starts
        if layer >= self.blocks.num_layers:
            raise LoadFailed(f"chunk of layer {layer}: this rank has {self.blocks.num_layers}")
        if (layer, first_block) != (self.layer, self.next_block):
            raise LoadFailed(
                f"chunk of layer {layer} at block {first_block} out of order (expected layer "
                f"{self.layer} at block {self.next_block})"
            )
        if not 0 < num_blocks <= total - first_block:
            raise LoadFailed(
                f"chunk of layer {layer} at block {first_block} has {num_blocks} blocks; "
                f"the load has {total}"
            )
        expected = num_blocks * self.blocks.block_bytes
        if len(data) != expected:
            raise LoadFailed(
                f"chunk of layer {layer}: {len(data)} bytes for {num_blocks} blocks, "
                f"expected {expected}"
            )
        ids = self.local_block_ids[first_block : first_block + num_blocks]
        self.blocks.write(layer, ids, data)
        self.next_block += num_blocks
        self.num_bytes += len(data)

    def check_complete(self) -> None:
        """LoadFailed unless every block of every layer was written."""
        total = len(self.local_block_ids)
        is_done = self.layer == self.blocks.num_layers - 1 and self.next_block == total
        if total and self.blocks.num_layers and not is_done:
            raise LoadFailed(
                f"the stream ended at layer {self.layer} block {self.next_block} of "
                f"{self.blocks.num_layers} layers x {total} blocks"
            )
