"""BlockIO moves whole blocks as bytes: a run of consecutive ids (read as a view) and scattered
ids give the same bytes, and what is written at some blocks is read back there, nowhere else."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.attention.selector import backend_class
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.runner.kv_cache import KvCacheSpec, PagedKVCache


def make_blocks(num_layers: int = 2) -> BlockIO:
    backend = backend_class("torch")(4, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    spec = KvCacheSpec(num_layers=num_layers, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = PagedKVCache(backend, spec, num_blocks=16, block_size=4, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return BlockIO(cache)


def test_a_run_and_scattered_ids_read_the_same_blocks() -> None:
    blocks = make_blocks()
    run = blocks.read(1, [3, 4, 5])
    pieces = [blocks.read(1, [b]) for b in (3, 4, 5)]
    planes = [np.frombuffer(p, np.uint8).reshape(2, 1, -1) for p in pieces]
    assert run == np.concatenate(planes, axis=1).tobytes()
    assert blocks.read(1, [5, 3]) != blocks.read(1, [3, 5])


def test_written_blocks_read_back_and_others_stay() -> None:
    source, target = make_blocks(), make_blocks()
    for layer in range(2):
        target.layers[layer].zero_()
    data = {layer: source.read(layer, [7, 2, 9]) for layer in range(2)}
    for layer in range(2):
        target.write(layer, [10, 11, 12], data[layer])  # a run
        target.write(layer, [1, 14, 5], data[layer])  # scattered
    for layer in range(2):
        assert target.read(layer, [10, 11, 12]) == data[layer]
        assert target.read(layer, [1, 14, 5]) == data[layer]
        assert not any(target.read(layer, [b]).strip(b"\0") for b in (2, 3, 4, 6, 13, 15))
