"""KV heads across tensor-parallel ranks: split when there are enough, replicated (vLLM's rule:
rank r holds KV head r * num_kv_heads // tp) when there are fewer KV heads than ranks."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import hf_config
from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import QKVParallelLinear, kv_heads_per_rank
from worker_svc.layers.tensor_source import InMemoryTensor
from worker_svc.model_loader.model_build import check_parallel_shape
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.models.model_config import ModelConfig

CPU = torch.device("cpu")
HEAD_DIM = 2
HIDDEN = 4


def head_rows(num_heads: int, offset: float) -> torch.Tensor:
    """A [num_heads * HEAD_DIM, HIDDEN] weight whose every row holds its head's number."""
    heads = torch.arange(num_heads, dtype=torch.float32).repeat_interleave(HEAD_DIM)
    return (heads + offset)[:, None].expand(-1, HIDDEN).contiguous()


def loaded_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> dict[str, list[int]]:
    qkv = QKVParallelLinear(
        HIDDEN,
        num_heads,
        num_kv_heads,
        HEAD_DIM,
        bias=False,
        parallel=ParallelState(rank=rank, tp_size=tp),
        dtype=torch.float32,
        device=CPU,
    )
    parts = {"q": head_rows(num_heads, 0), "k": head_rows(num_kv_heads, 100)}
    parts["v"] = head_rows(num_kv_heads, 200)
    for i, name in enumerate(parts):
        qkv.load("weight", InMemoryTensor(parts[name]), i)
    rows = qkv.weight[::HEAD_DIM, 0].tolist()
    num_q, num_kv = num_heads // tp, kv_heads_per_rank(num_kv_heads, tp)
    return {
        "q": [int(h) for h in rows[:num_q]],
        "k": [int(h) - 100 for h in rows[num_q : num_q + num_kv]],
        "v": [int(h) - 200 for h in rows[num_q + num_kv :]],
    }


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp", "expected_kv"),
    [
        (4, 1, 2, [[0], [0]]),  # 1 KV head at TP=2: both ranks hold it
        (8, 4, 8, [[0], [0], [1], [1], [2], [2], [3], [3]]),  # 4 KV heads at TP=8
        (8, 2, 4, [[0], [0], [1], [1]]),
        (8, 4, 2, [[0, 1], [2, 3]]),  # enough KV heads: split, not replicated
        (4, 4, 1, [[0, 1, 2, 3]]),
    ],
)
def test_each_rank_holds_the_kv_heads_its_query_heads_use(
    num_heads: int, num_kv_heads: int, tp: int, expected_kv: list[list[int]]
) -> None:
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    for rank in range(tp):
        heads = loaded_heads(num_heads, num_kv_heads, tp, rank)
        per_rank = num_heads // tp
        assert heads["q"] == list(range(rank * per_rank, (rank + 1) * per_rank))
        assert heads["k"] == heads["v"] == expected_kv[rank]
        assert {q // group for q in heads["q"]} <= set(heads["k"])


def model_config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    hf = hf_config(
        "llama",
        architectures=["LlamaForCausalLM"],
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        hidden_size=16 * num_heads,
    )
    return ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp", "needle"),
    [
        (4, 2, 3, "must divide the 4 attention heads"),
        (6, 2, 3, "must divide the 2 KV heads, or be a multiple of them"),
        (12, 3, 6, None),  # 3 KV heads, 6 ranks: each head on 2 ranks
        (8, 1, 8, None),
    ],
)
def test_which_layouts_are_refused(
    num_heads: int, num_kv_heads: int, tp: int, needle: str | None
) -> None:
    config = LoadModelConfig.of("m", tensor_parallel_size=tp)
    model = model_config(num_heads, num_kv_heads)
    if needle is None:
        check_parallel_shape(config, model)
        return
    with pytest.raises(ValueError, match=needle):
        check_parallel_shape(config, model)
