"""MXFP4 (`quant_method: mxfp4`): gpt-oss's expert weights, dequantized at load.

OpenAI's gpt-oss checkpoints store every MoE expert projection as MXFP4 (the OCP microscaling
format): 4-bit e2m1 values, two per byte (`*_blocks` [E, out, in / 32, 16]), and one e8m0
power-of-two scale per 32 of them (`*_scales` [E, out, in / 32]); everything else (attention,
router, embeddings, LM head) is bfloat16. Here the model that declares it reads MXFP4 experts
(`reads_mxfp4`, gpt-oss) dequantizes each layer's local experts into the compute dtype as it
loads them, with transformers' own unpacking (layers/mxfp4.py: `convert_moe_packed_tensors`,
what transformers runs on CPU), and then serves them as unquantized experts: the weights take 4x their bytes in
bfloat16 (about 13 GB of experts for gpt-oss-20b) and decode reads them at that size. An MXFP4
expert kernel would keep them packed; it is not built.
"""

from __future__ import annotations

from typing import Any, Self

from worker_svc.quantization.config import QuantizationConfig


class Mxfp4Config(QuantizationConfig):
    """An MXFP4 checkpoint: its experts are read by the model's own loader (`reads_mxfp4`)."""

    def __init__(self, modules_to_not_convert: tuple[str, ...]) -> None:
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        skipped = config.get("modules_to_not_convert") or ()
        return cls(tuple(str(m) for m in skipped))

    @classmethod
    def float_refusal(cls, what: str) -> str:
        return f"--quantization mxfp4 reads gpt-oss's MXFP4 checkpoints; {what} is not one"
