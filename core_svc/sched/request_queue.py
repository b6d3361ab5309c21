"""Waiting queues: first-come-first-served, or by (priority, arrival)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from core_svc.request import Request


class RequestQueue(ABC):
    """Requests waiting for admission; `peek_request` is the next one to try."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a preempted request back where it is tried first (FCFS) or by rank."""

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put requests taken out back, in their order, where they are tried first (FCFS) or
        by rank."""
        for request in reversed(requests):
            self.prepend_request(request)

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, req_handle) first: req_handle grows with arrival, so ties go to
    the earlier request, and a preempted request keeps its original rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.req_handle, request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][2]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[2]) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


def create_request_queue(policy: str) -> RequestQueue:
    """The queue of scheduler.policy (its rule admits "fcfs" and "priority" only)."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
