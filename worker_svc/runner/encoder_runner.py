"""The multimodal part of a step on one rank: check each new request's images, run the vision
encoder for the items the step schedules, and hand the model runner the embedding rows that
replace the placeholder tokens of the step.

    new requests' mm_features --check (every rank: shape, placeholders, hash)--> kept per request
    scheduled_encoder_inputs  --encode_images (first stage)--> EncoderCache[hash]
    step's positions x placeholder ranges --> (token index, embedding rows)
        --> written over the placeholders' token embeddings (`embed`)

An item a step needs but the cache lacks (a rank restarted under the core, or a request taken
back out of a step after another request hit its entry) is encoded on demand: the rank keeps
every request's encoder inputs until the request finishes, so it never has to refuse.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from splitserve_contracts.mm_features import feature_identifier, tensor_problem
from worker_svc.models.interfaces import SupportsImages, uses_mrope
from worker_svc.runner.encoder_cache import EncoderCache
from worker_svc.runner.step_inputs import StepInputs
from worker_svc.scheduler_output import MultiModalInput, NewRequestData, SchedulerOutput
from worker_svc.step_checks import check_step_shape

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

MmEmbeddings = tuple[torch.Tensor, torch.Tensor]
"""(token indices within the step, embedding rows) to write over the token embeddings."""


class EncoderRunner:
    """Multimodal state of a rank serving a model that takes images; see the module docstring."""

    def __init__(self, model: SupportsImages, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.features: dict[int, tuple[MultiModalInput, ...]] = {}
        self.mrope: dict[int, tuple[np.ndarray, int]] = {}
        """M-RoPE models: each request with images' prompt positions [3, prompt] and delta."""
        self.cache = EncoderCache()
        self.num_on_demand = 0
        """Items encoded although the step did not schedule them (see the module docstring)."""

    # -- state ---------------------------------------------------------------------------------

    def refuse_bad_requests(self, step: SchedulerOutput) -> tuple[SchedulerOutput, dict[int, str]]:
        """The step without the new requests whose images are invalid, and why each was
        refused. Every rank checks, so every rank refuses the same requests."""
        check_step_shape(step)  # a malformed step fails whole, before anything is filtered
        refused = {}
        for new in step.scheduled_new_reqs:
            problem = self._problem(new) if new.mm_features else None
            if problem is not None:
                refused[new.req_handle] = problem
        if not refused:
            return step, {}
        return _without_new_requests(step, refused), refused

    def _problem(self, new: NewRequestData) -> str | None:
        previous_end = 0
        for i, f in enumerate(new.mm_features):
            problem = tensor_problem(f.dtype, f.shape, f.data)
            if problem is not None:
                return f"mm_features[{i}]: {problem}"
            problem = self.model.image_problem(f.shape, f.grid_thw, f.length)
            if problem is not None:
                return f"mm_features[{i}]: {problem}"
            if f.offset < previous_end or f.end > len(new.prompt_token_ids):
                return f"mm_features[{i}]: placeholders overlap or leave the prompt"
            if feature_identifier(f.dtype, f.shape, f.data, f.grid_thw) != f.identifier:
                return f"mm_features[{i}]: the identifier is not the hash of its data"
            previous_end = f.end
        return None

    def update(self, step: SchedulerOutput, failed: dict[int, str]) -> None:
        """Forget finished and refused requests, keep new ones' items, drop freed entries."""
        for handle in [*step.finished_req_handles.tolist(), *failed]:
            self.features.pop(handle, None)
            self.mrope.pop(handle, None)
        for new in step.scheduled_new_reqs:
            if new.mm_features and new.req_handle not in failed:
                self.features[new.req_handle] = new.mm_features
                if uses_mrope(self.model):
                    images = [(f.offset, f.grid_thw) for f in new.mm_features]
                    num_prompt = len(new.prompt_token_ids)
                    self.mrope[new.req_handle] = self.model.mrope_positions(num_prompt, images)
        self.cache.free(step.free_encoder_mm_hashes)

    # -- the step ------------------------------------------------------------------------------

    def step_embeddings(self, step: SchedulerOutput, inputs: StepInputs) -> MmEmbeddings | None:
        """Encode the step's scheduled items, then gather the rows of every placeholder the
        step computes; None when it computes none."""
        if not self.features:
            return None
        self._encode(
            [
                self.features[handle][i]
                for handle, input_ids in step.scheduled_encoder_inputs.items()
                if handle in self.features
                for i in input_ids
                if i < len(self.features[handle])
            ]
        )
        rows: list[torch.Tensor] = []
        index: list[np.ndarray] = []
        qsl = inputs.query_start_loc
        for k, handle in enumerate(inputs.req_handles.tolist()):
            features = self.features.get(handle)
            if not features:
                continue
            first = int(qsl[k])
            start = int(inputs.positions[first])
            end = start + int(qsl[k + 1]) - first
            for f in features:
                if f.offset >= end:
                    break
                if f.end <= start:
                    continue
                lo, hi = max(start, f.offset), min(end, f.end)
                rows.append(self._output(f)[lo - f.offset : hi - f.offset])
                index.append(np.arange(first + lo - start, first + hi - start))
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(index)).to(self.device), torch.cat(rows)

    def mrope_positions(self, inputs: StepInputs) -> np.ndarray:
        """The step's M-RoPE positions [3, num_tokens]: a prompt's from its table, a later
        token's (and every token of a request without images) its position + delta."""
        positions = inputs.positions
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        qsl = inputs.query_start_loc
        for k, handle in enumerate(inputs.req_handles.tolist()):
            if handle not in self.mrope:
                continue
            table, delta = self.mrope[handle]
            run = slice(int(qsl[k]), int(qsl[k + 1]))
            p = positions[run]
            in_prompt = p < table.shape[1]
            out[:, run] = np.where(
                in_prompt, table[:, np.minimum(p, table.shape[1] - 1)], p + delta
            )
        return out

    def _encode(self, items: list[MultiModalInput]) -> None:
        """Run the vision encoder once over every item not cached yet (duplicates once)."""
        todo = list({f.identifier: f for f in items if f.identifier not in self.cache}.values())
        if not todo:
            return
        pixels = [_tensor(f).to(self.device) for f in todo]
        embeddings = self.model.encode_images(pixels, [f.grid_thw for f in todo])
        for f, rows in zip(todo, embeddings, strict=True):
            self.cache.put(f.identifier, rows)

    def _output(self, f: MultiModalInput) -> torch.Tensor:
        rows = self.cache.get(f.identifier)
        if rows is None:
            self.num_on_demand += 1
            logger.debug("encoding %s on demand (not scheduled by the core)", f.identifier[:12])
            self._encode([f])
            rows = self.cache.get(f.identifier)
            assert rows is not None
        return rows

    def embed(self, input_ids: torch.Tensor, mm: MmEmbeddings) -> torch.Tensor:
        """The first decoder layer's input: token embeddings, placeholders' rows replaced."""
        index, embeddings = mm
        hidden = self.model.embed_input_ids(input_ids)
        hidden[index] = embeddings.to(hidden.dtype)
        return hidden


def _tensor(f: MultiModalInput) -> torch.Tensor:
    return torch.frombuffer(bytearray(f.data), dtype=_TORCH_DTYPES[f.dtype]).view(f.shape)


def _without_new_requests(step: SchedulerOutput, refused: dict[int, str]) -> SchedulerOutput:
    """`step` minus the refused new requests (their entries of num_scheduled_tokens too)."""
    num_new = len(step.scheduled_new_reqs)
    keep = np.array([r.req_handle not in refused for r in step.scheduled_new_reqs], np.bool_)
    num_scheduled = np.concatenate(
        [step.num_scheduled_tokens[:num_new][keep], step.num_scheduled_tokens[num_new:]]
    )
    return dataclasses.replace(
        step,
        scheduled_new_reqs=[r for r in step.scheduled_new_reqs if r.req_handle not in refused],
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=int(num_scheduled.sum()),
        scheduled_encoder_inputs={
            h: ids for h, ids in step.scheduled_encoder_inputs.items() if h not in refused
        },
    )
