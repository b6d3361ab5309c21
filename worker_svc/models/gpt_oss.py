"""gpt-oss (`GptOssForCausalLM`, gpt-oss-20b / -120b): a Llama-shaped decoder whose attention has
sinks and whose MLPs are sparse experts with a clamped SwiGLU.

As transformers' GptOss code computes it:
- attention: q/k/v/o biased; each query head has a learned sink logit that joins the softmax's
  denominator (`self_attn.sinks`; the attention backend's `has_sinks`); layers alternate
  sliding-window (128) and full attention (`layer_types`); YaRN rope, neox layout;
- experts: the router is biased, takes the top-k logits and softmaxes over those; expert e is
  `(min(up, l) .. clamped to [-l, l] + 1) * glu(gate)` with glu(g) = g * sigmoid(alpha * g),
  g = min(gate, l), l = swiglu_limit, alpha = swiglu_alpha, and its gate/up and down
  projections are biased. The checkpoint stores all experts of a layer in one tensor each,
  gate and up interleaved by column (`mlp.experts.gate_up_proj` [E, hidden, 2I]); they are split
  and transposed at load into layers/moe.py's layout, so experts run grouped as Mixtral's and
  shard the same ways (every expert's slice, or whole experts with expert parallelism). At TP
  without expert parallelism the down-projection bias is added by rank 0 only (the ranks' sums
  are all-reduced);
- MXFP4 checkpoints (OpenAI's: `quant_method: mxfp4`) store the experts as `*_blocks` and
  `*_scales`: each layer's local experts are dequantized at load (quantization/mxfp4.py) and
  then split as above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend, AttentionOptions
from worker_svc.distributed import ParallelState
from worker_svc.layers.moe import FusedExperts, MoeRouter, grouped_linear
from worker_svc.layers.mxfp4 import dequantize_mxfp4
from worker_svc.layers.rotary import Rotation
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_rows
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM, join_prefix
from worker_svc.models.llama import LlamaAttention, LlamaDecoderLayer
from worker_svc.models.mixtral import MoeModelConfig, read_moe_config
from worker_svc.models.model_config import quant_method
from worker_svc.models.weight_names import WeightTarget

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.router\.(weight|bias)$")
_MXFP4 = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$"
)
_SINKS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.sinks$")


@dataclass(frozen=True, slots=True, kw_only=True)
class GptOssConfig(MoeModelConfig):
    """gpt-oss's clamped SwiGLU; every layer attends with sinks."""

    swiglu_alpha: float
    swiglu_limit: float
    mxfp4_experts: bool
    """The checkpoint stores the experts in MXFP4 (blocks and scales), dequantized at load."""

    def layer_attention(self, layer: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=self.layer_window(layer), has_sinks=True)


class GptOssAttention(LlamaAttention):
    """Llama's attention with this rank's heads' sink logits, handed to its backend view."""

    def __init__(
        self, build: BuildContext, backend: AttentionBackend, rotary: Rotation, prefix: str
    ) -> None:
        super().__init__(build, backend, rotary, prefix)
        self.first_head = build.parallel.tp_rank * self.num_heads
        self.sinks = nn.Parameter(
            torch.empty(self.num_heads, dtype=build.dtype, device=build.device), False
        )

    def load(self, param: str, source: TensorSource, part: int) -> None:
        if param != "sinks":
            super().load(param, source, part)
            return
        copy_checked(self.sinks, read_rows(source, self.first_head, self.num_heads), param)
        self.backend = self.backend.with_sinks(self.sinks)


class GptOssExperts(FusedExperts):
    """layers/moe.py's experts with biases and the clamped SwiGLU; loaded from the stacked,
    interleaved checkpoint tensors."""

    def __init__(
        self, config: GptOssConfig, *, parallel: ParallelState, build: BuildContext
    ) -> None:
        hidden = config.hidden_size
        super().__init__(
            hidden, config.moe, parallel=parallel, dtype=build.dtype, device=build.device
        )
        e, size = self.num_local_experts, self.shard_size
        args: dict[str, Any] = {"dtype": build.dtype, "device": build.device}
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * size, **args), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(e, hidden, **args), requires_grad=False)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.adds_down_bias = parallel.enable_expert_parallel or parallel.tp_rank == 0
        self.mxfp4 = config.mxfp4_experts
        self.dtype = build.dtype
        self._packed: dict[tuple[str, int], torch.Tensor] = {}
        """MXFP4 blocks (part 0) or scales (part 1) of a weight whose other half is not in yet."""

    def num_parts(self, param_name: str) -> int:
        """One stacked tensor holds every expert; an MXFP4 weight is two (blocks, scales)."""
        return 2 if self.mxfp4 and param_name in ("w13_weight", "w2_weight") else 1

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """This rank's experts of a stacked tensor (MXFP4 weights: once blocks and scales are
        both in, dequantized)."""
        first = self.expert_start
        local = source[first : first + self.num_local_experts]
        if self.num_parts(param_name) == 1:
            self._load_stacked(param_name, local)
            return
        self._packed[(param_name, part)] = local
        blocks, scales = self._packed.get((param_name, 0)), self._packed.get((param_name, 1))
        if blocks is not None and scales is not None:
            del self._packed[(param_name, 0)], self._packed[(param_name, 1)]
            self._load_stacked(param_name, dequantize_mxfp4(blocks, scales, self.dtype))

    def _load_stacked(self, param_name: str, stacked: torch.Tensor) -> None:
        """Local experts' stacked tensor: gate_up [e, hidden, 2I] (columns gate0 up0 gate1 up1
        ..), its bias [e, 2I], down [e, I, hidden], its bias [e, hidden]."""
        size, start = self.shard_size, self.shard_start
        if param_name in ("w13_weight", "w13_bias"):
            gate, up = stacked[..., 0::2], stacked[..., 1::2]  # [e, (hidden,) I] each
            halves = [h[..., start : start + size] for h in (gate, up)]
            loaded = torch.cat(halves, dim=-1)
            loaded = loaded.transpose(1, 2) if param_name == "w13_weight" else loaded
        elif param_name == "w2_weight":
            loaded = stacked[:, start : start + size].transpose(1, 2)
        elif param_name == "w2_bias":
            loaded = stacked
        else:
            raise ValueError(f"gpt-oss experts have no parameter {param_name!r}")
        copy_checked(getattr(self, param_name), loaded.contiguous(), param_name)

    def expert_mlp(
        self, rows: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor
    ) -> torch.Tensor:
        size = self.shard_size
        gate_up = grouped_linear(rows, self.w13_weight, ends).add_(self.w13_bias[expert_ids])
        gate = gate_up[:, :size].clamp(max=self.limit)
        up = gate_up[:, size:].clamp(min=-self.limit, max=self.limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = grouped_linear(hidden, self.w2_weight, ends)
        return out.add_(self.w2_bias[expert_ids]) if self.adds_down_bias else out


class GptOssMoeBlock(nn.Module):
    """The biased router's top-k logits softmaxed, the chosen experts, one all-reduce."""

    def __init__(self, build: BuildContext) -> None:
        super().__init__()
        config = build.config
        assert isinstance(config, GptOssConfig)
        self.top_k = config.moe.top_k
        self.parallel = build.parallel
        num_experts, hidden = config.moe.num_experts, config.hidden_size
        self.router = MoeRouter(
            hidden, num_experts, dtype=build.dtype, device=build.device, bias=True
        )
        self.experts = GptOssExperts(config, parallel=build.parallel, build=build)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x).float(), self.top_k, dim=-1)
        out = self.experts(x, torch.softmax(top, dim=-1), ids)
        return out if self.parallel.tp_size == 1 else self.parallel.all_reduce(out)


class GptOssForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a gpt-oss model (bfloat16 or MXFP4 experts)."""

    reads_mxfp4: ClassVar[bool] = True
    config: GptOssConfig

    @classmethod
    def read_config(cls, hf: Any) -> GptOssConfig:
        quantization = getattr(hf, "quantization_config", None)
        return GptOssConfig.from_hf_config(
            hf,
            moe=read_moe_config(hf, renormalize=False),
            swiglu_alpha=float(hf.swiglu_alpha),
            swiglu_limit=float(hf.swiglu_limit),
            mxfp4_experts=bool(quantization) and quant_method(quantization) == "mxfp4",
        )

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        attention = GptOssAttention(build, backend, self.rotary, join_prefix(prefix, "self_attn"))
        mlp = GptOssMoeBlock(build)
        return LlamaDecoderLayer(build, backend, self.rotary, prefix, mlp=mlp, attention=attention)

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if (match := _MXFP4.match(name)) and self.config.mxfp4_experts:
            param = "w13_weight" if match.group(2) == "gate_up_proj" else "w2_weight"
            part = 0 if match.group(3) == "blocks" else 1
            return [WeightTarget(int(match.group(1)), "mlp.experts", param, part)]
        if match := _EXPERTS.match(name):
            which = "w13" if match.group(2) == "gate_up_proj" else "w2"
            param = f"{which}_{'bias' if match.group(3) else 'weight'}"
            return [WeightTarget(int(match.group(1)), "mlp.experts", param)]
        if match := _ROUTER.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.router", match.group(2))]
        if match := _SINKS.match(name):
            return [WeightTarget(int(match.group(1)), "self_attn", "sinks")]
        return super().resolve_weight_name(name)
