"""FP8 checkpoints (`quantization_config.quant_method: fp8`): the registry's `fp8`. The layout
(per-tensor or block scales) and the linear methods are in worker_svc/layers/fp8.py; the scan for
the scales in worker_svc/model_loader/weights.py (`open_fp8_checkpoint`)."""

from __future__ import annotations

from splitserve_runtime.quantization_names import ONLINE_METHODS, spoken
from worker_svc.layers.fp8 import Fp8Format
from worker_svc.quantization.config import SchemeConfig


class Fp8Config(SchemeConfig[Fp8Format]):
    """vLLM's Fp8Config, for serialized FP8 checkpoints only (no online FP8 quantization): the
    scheme is the weights' layout (per-tensor or block scales)."""

    parse_scheme = staticmethod(Fp8Format.from_quantization_config)

    @classmethod
    def float_refusal(cls, what: str) -> str:
        return (
            f"--quantization fp8 needs an FP8 checkpoint; {what} is not quantized (online FP8 "
            f"quantization is not supported: use --quantization {spoken(ONLINE_METHODS, 'or')})"
        )
