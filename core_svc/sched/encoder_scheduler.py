"""The scheduler's multimodal side: which encoder inputs run in a step, within an encoder
compute budget, and what the workers' encoder cache holds (vLLM's encoder_compute_budget and
EncoderCacheManager, in encoder tokens: one per placeholder token).

A step that computes placeholder positions of an item needs the item's encoder output on the
workers. Either it is cached there (an earlier step, or another request, ran the encoder for
the same content hash), or this step schedules the encoder for it, which reserves its room in
the cache until every request using it has computed past it. When the item cannot be scheduled
(budget spent, cache full) the request's chunk stops before the item's first placeholder: a
chunk only ever ends inside an item whose output is cached. Unreferenced entries stay cached
(reusable by a later request with the same image) until their room is needed; the evicted
hashes go to the workers with the next step (free_encoder_mm_hashes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from core_svc.request import Request


@dataclass(slots=True)
class EncoderCacheStats:
    """Items looked up when a request first needs them, cumulative."""

    queries: int = 0
    hits: int = 0


class EncoderScheduler:
    """Plans and commits encoder inputs step by step; see the module docstring."""

    def __init__(self, compute_budget: int, cache_size: int, disable_chunked_mm_input: bool):
        self.compute_budget = compute_budget
        self.cache_size = cache_size
        self.disable_chunked_mm_input = disable_chunked_mm_input
        self.cached: dict[str, set[int]] = {}
        """Content hash -> handles of the requests that still need its output."""
        self.freeable: OrderedDict[str, int] = OrderedDict()
        """Cached entries no request needs, oldest first, with their sizes."""
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        """Free slots plus the slots of freeable entries."""
        self.req_inputs: dict[int, set[int]] = {}
        """Request handle -> indices of its items it holds a reference on."""
        self.freed: list[str] = []
        self.stats = EncoderCacheStats()
        self.budget_left = compute_budget

    def begin_step(self) -> None:
        self.budget_left = self.compute_budget

    def plan(
        self, request: Request, num_computed: int, num_new_tokens: int
    ) -> tuple[int, list[int]]:
        """How many of num_new_tokens may run, and which items' encoders must run for them
        (an item a request already scheduled this step counts as cached). Takes references on
        the cached items the chunk uses, which `free` drops; the rest waits for `commit`."""
        to_schedule: list[int] = []
        planned: set[str] = set()
        num_tokens_to_schedule = 0
        end = num_computed + num_new_tokens
        held = self.req_inputs.get(request.req_handle, ())
        for i, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed or i in held:
                continue
            if feature.identifier in planned or self._reference(request, i):
                continue  # the same image earlier in this chunk, or cached
            if (
                self.disable_chunked_mm_input
                and num_computed < feature.offset
                and end < feature.end
            ):
                return feature.offset - num_computed, to_schedule
            if not self._can_allocate(feature.length + num_tokens_to_schedule):
                return max(0, feature.offset - num_computed), to_schedule
            num_tokens_to_schedule += feature.length
            to_schedule.append(i)
            planned.add(feature.identifier)
        return num_new_tokens, to_schedule

    def _reference(self, request: Request, index: int) -> bool:
        """Count a first lookup of the item by this request; on a hit, hold a reference."""
        identifier = request.mm_features[index].identifier
        self.stats.queries += 1
        refs = self.cached.get(identifier)
        if refs is None:
            return False
        self.stats.hits += 1
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(identifier)
        refs.add(request.req_handle)
        self.req_inputs.setdefault(request.req_handle, set()).add(index)
        return True

    def _can_allocate(self, num_tokens: int) -> bool:
        """Whether num_tokens more fit the step's budget and the cache, evicting freeable
        entries (oldest first) to make room."""
        if num_tokens > self.budget_left or num_tokens > self.num_freeable_slots:
            return False
        while num_tokens > self.num_free_slots:
            identifier, size = self.freeable.popitem(last=False)
            del self.cached[identifier]
            self.freed.append(identifier)
            self.num_free_slots += size
        return True

    def commit(self, request: Request, input_ids: list[int]) -> None:
        """The request was scheduled with these encoder inputs: reserve their cache room."""
        for i in input_ids:
            feature = request.mm_features[i]
            self.budget_left -= feature.length
            self.cached.setdefault(feature.identifier, set()).add(request.req_handle)
            self.req_inputs.setdefault(request.req_handle, set()).add(i)
            self.num_free_slots -= feature.length
            self.num_freeable_slots -= feature.length

    def cancel(self, request: Request, input_ids: list[int]) -> None:
        """The request was taken back out of the step before its encoder inputs ran: their
        budget comes back, and entries only it used are forgotten (the workers never made
        them). An entry another request already hit this step stays; the workers then make it
        for that request (they make any missing entry a step needs)."""
        held = self.req_inputs.get(request.req_handle, set())
        for i in input_ids:
            feature = request.mm_features[i]
            self.budget_left += feature.length
            if self.cached.get(feature.identifier) == {request.req_handle}:
                del self.cached[feature.identifier]
                self.num_free_slots += feature.length
                self.num_freeable_slots += feature.length
                held.discard(i)

    def release_computed(self, request: Request) -> None:
        """Drop the request's references on items it has computed past."""
        held = self.req_inputs.get(request.req_handle)
        if not held:
            return
        num_computed = request.num_computed_tokens
        for i in [i for i in held if request.mm_features[i].end <= num_computed]:
            self._release(request, i)

    def free(self, request: Request) -> None:
        """Drop every reference of a finished or preempted request."""
        for i in list(self.req_inputs.get(request.req_handle, ())):
            self._release(request, i)
        self.req_inputs.pop(request.req_handle, None)

    def _release(self, request: Request, index: int) -> None:
        held = self.req_inputs[request.req_handle]
        held.discard(index)
        feature = request.mm_features[index]
        refs = self.cached.get(feature.identifier)
        if refs is None or any(
            request.mm_features[i].identifier == feature.identifier for i in held
        ):
            return
        refs.discard(request.req_handle)
        if not refs and feature.identifier not in self.freeable:
            self.freeable[feature.identifier] = feature.length
            self.num_freeable_slots += feature.length

    def reset(self) -> None:
        """The ranks were brought up again with empty encoder caches: nothing is cached and
        nothing is left to free. Only when no request holds a reference (every one was
        requeued); the stats go on."""
        if any(self.req_inputs.values()):
            raise AssertionError("requests still hold encoder cache references")
        self.cached.clear()
        self.freeable.clear()
        self.req_inputs.clear()
        self.freed = []
        self.num_free_slots = self.num_freeable_slots = self.cache_size

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the workers drop them."""
        freed, self.freed = self.freed, []
        return freed
