"""Phi-3 (and Phi-4-mini): the Llama decoder with checkpoints that store q/k/v and gate/up fused.

The fused `qkv_proj` and `gate_up_proj` tensors are split at load into the parts our
tensor-parallel layers shard separately (rank r then holds [q_r; k_r; v_r] and [gate_r; up_r]).
Phi-3's `longrope` and Phi-4-mini's partial rotary are the rotary embedding's business.
"""

from __future__ import annotations

from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.weight_names import WeightTarget, fused_targets, resolve_weight_name

_QKV = "self_attn.qkv_proj.weight"
_GATE_UP = "mlp.gate_up_proj.weight"


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with fused-tensor checkpoint names."""

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        layer, _, suffix = name.removeprefix("model.layers.").partition(".")
        if name.startswith("model.layers.") and suffix in (_QKV, _GATE_UP):
            return self._split_targets(int(layer), suffix)
        return resolve_weight_name(name, self.config.tie_word_embeddings)

    def _split_targets(self, layer: int, suffix: str) -> list[WeightTarget]:
        config = self.config
        if suffix == _QKV:
            q_rows = config.num_heads * config.head_dim
            kv_rows = config.num_kv_heads * config.head_dim
            module, sizes = "self_attn.qkv_proj", [q_rows, kv_rows, kv_rows]
        else:
            module, sizes = "mlp.gate_up_proj", [config.intermediate_size] * 2
        return fused_targets(layer, module, sizes)
