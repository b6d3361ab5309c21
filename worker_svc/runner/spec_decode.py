"""Speculative decoding on a rank: n-gram drafts proposed where the tokens are, verified in the
step's own forward by rejection sampling (vLLM's NgramProposer and RejectionSampler).

    SchedulerOutput.num_spec_tokens (slots) --propose--> drafts written after each decoding row's
        tokens in the token table; the row computes 1 + (its drafts) tokens, not its slots
    forward: logits at each of those positions (the drafts' KV lands in the paged cache as any
        token's; what is rejected is overwritten later)
    sampler on every position (position j sees the j drafts before it: penalties, min_tokens,
        grammar masks) --verify--> accepted drafts + one token

Every rank holds the same token ids (the same diffs, or the same sampled tokens under async
scheduling), so every rank proposes the same drafts and lays the step out the same way; drafts
never travel. The engine core computes them too when a grammar must mask each position.

Verification. A draft d at position j is accepted when the token the sampler draws at j is d;
the first position whose draw differs ends the run and its draw is the output (vLLM's recovered
token), and a run with every draft accepted ends with the draw after the last draft (the bonus
token). For greedy rows this is argmax equality (token-identical to decoding without drafts).
For random rows with an n-gram draft (a one-hot draft distribution q, as vLLM treats drafts
without probabilities) it is vLLM's rejection sampler realised with the sampler's exponential
race: P(draw = d) = p(d) = min(1, p(d) / q(d)), and a rejected position's draw is distributed
as p without d, renormalised, which is vLLM's recovered distribution max(p - q, 0) normalised.
So the output distribution is p's at every position, and the draw at each output position is
the one decoding without drafts would make: a seeded request's generator is wound back to one
row of draws per output token, so it samples the same tokens with or without drafts and after
a recovery (SamplingStates.resync_generator counts on that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from splitserve_contracts.spec_decode import SpeculativeConfig, propose_ngram
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.step_inputs import StepInputs, StepPlan, ragged_cols
from worker_svc.sample.sampling_metadata import skip_draws

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Verified:
    """What each sampling request of a step keeps: num_sampled[i] tokens (its accepted drafts,
    then one drawn token), the next ones of `token_ids`; `logits_rows` are their rows among the
    step's logits (to pick their logprobs)."""

    num_sampled: IntArray
    token_ids: IntArray
    logits_rows: IntArray


class SpecDecoder:
    """Proposes a rank's drafts and verifies them; see the module docstring."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._generator_states: dict[int, torch.Tensor] = {}
        """Seeded rows verifying drafts: their generator's state before the step's draws."""

    def propose(self, batch: InputBatch, plan: StepPlan) -> StepPlan:
        """Fill the draft slots: each row's n-gram drafts go after its tokens in the token table
        (not counted in its tokens), and the row computes its one token plus its drafts."""
        num_spec = plan.num_spec
        if num_spec is None:
            return plan
        config = self.config
        num_drafts = np.zeros_like(num_spec)
        for i in np.flatnonzero(num_spec).tolist():
            row = int(plan.rows[i])
            num_tokens = int(batch.num_tokens[row])
            drafts = propose_ngram(
                batch.token_ids[row, :num_tokens],
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                int(num_spec[i]),
                self.max_model_len,
            )
            batch.token_ids[row, num_tokens : num_tokens + len(drafts)] = drafts
            num_drafts[i] = len(drafts)
        num_scheduled = plan.num_scheduled_tokens - num_spec + num_drafts
        return StepPlan(plan.rows, num_scheduled, plan.fresh_block_ids, plan.failed, num_drafts)

    def expand(self, batch: InputBatch, inputs: StepInputs) -> tuple[IntArray, IntArray]:
        """The sampler's rows: each sampling request once per logits row (1 + its drafts), with
        the tokens before each (its tokens, then the drafts before that position)."""
        rows = inputs.rows[inputs.sampling_reqs]
        num_tokens = batch.num_tokens[rows]
        if inputs.num_drafts is None:
            return rows, num_tokens
        num_logits = inputs.num_drafts + 1
        offsets = ragged_cols(np.zeros(len(rows), np.int64), num_logits)
        return np.repeat(rows, num_logits), np.repeat(num_tokens, num_logits) + offsets

    def save_generators(self, batch: InputBatch, inputs: StepInputs) -> None:
        """Remember the seeded generators of the rows about to draw for several positions."""
        self._generator_states.clear()
        if inputs.num_drafts is None or not batch.sampling.generators:
            return
        rows = inputs.rows[inputs.sampling_reqs]
        for row in rows[inputs.num_drafts > 0].tolist():
            generator = batch.sampling.generators.get(row)
            if generator is not None:
                self._generator_states[row] = generator.get_state()

    def verify(self, batch: InputBatch, inputs: StepInputs, sampled: IntArray) -> Verified:
        """Accept each request's drafts up to the first position whose draw differs; see the
        module docstring. `sampled`: the draw at every logits row."""
        assert inputs.num_drafts is not None
        num_drafts = inputs.num_drafts
        starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        num_rows = len(sampled)
        is_draft = np.ones(num_rows, np.bool_)
        is_draft[starts + num_drafts] = False  # a request's last row follows its last draft
        is_match = np.zeros(num_rows, np.bool_)
        next_inputs = inputs.input_ids[inputs.logits_indices[is_draft] + 1]
        is_match[is_draft] = sampled[is_draft] == next_inputs
        mismatch = np.where(is_match, num_rows, np.arange(num_rows))
        num_sampled = np.minimum.reduceat(mismatch, starts) - starts + 1 if len(starts) else starts
        logits_rows = ragged_cols(starts, num_sampled)
        self._rewind_generators(batch, inputs.rows[inputs.sampling_reqs], num_sampled)
        return Verified(num_sampled, sampled[logits_rows], logits_rows)

    def _rewind_generators(self, batch: InputBatch, rows: IntArray, num_sampled: IntArray) -> None:
        """A seeded row drew one row of noise per position; it keeps the draws of the tokens it
        output only (one per token, as decoding without drafts draws)."""
        if not self._generator_states:
            return
        sampling = batch.sampling
        for row, count in zip(rows.tolist(), num_sampled.tolist(), strict=True):
            state = self._generator_states.get(row)
            if state is not None:
                generator = sampling.generators[row]
                generator.set_state(state)
                skip_draws(generator, count, sampling.vocab_size, sampling.device)
        self._generator_states.clear()
