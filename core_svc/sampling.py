"""How one request is sampled and when it stops: the engine core's view of SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Every field of the proto SamplingParams, with vLLM's defaults already applied.

    `None` keeps vLLM's "unset" meaning where the proto field is `optional` and has no
    neutral value (seed, max_tokens, logprobs, prompt_logprobs). The core only reads the
    stop-related fields and `prompt_logprobs`; the rest travels to the workers unchanged.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()
    spaces_between_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so such requests never hit."""
        return self.prompt_logprobs is not None

    def all_stop_token_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """Token ids that may end the request: stop_token_ids, plus EOS unless ignore_eos."""
        if eos_token_id is None or self.ignore_eos or eos_token_id in self.stop_token_ids:
            return self.stop_token_ids
        return (*self.stop_token_ids, eos_token_id)
