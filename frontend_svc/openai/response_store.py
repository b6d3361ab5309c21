"""The Responses API's store (`store: true`): the responses this frontend created, for
`previous_response_id`, GET /v1/responses/{id} and cancel. Bounded in memory, per frontend
(--responses-store-size responses, each kept --responses-store-ttl seconds, and at most
MAX_STORE_BYTES of JSON in all: follow-ups repeat their history, so a long chain of large
conversations is bounded by bytes too; the oldest go first): a client behind several frontends
must reach the same one, or send the conversation again (`input` with the earlier items) instead
of previous_response_id.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RESPONSES_STORE_SIZE = 1000
DEFAULT_RESPONSES_STORE_TTL = 3600.0
MAX_STORE_BYTES = 256 * 1024 * 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]
    """The response object as last sent (status, output, usage...)."""
    conversation: list[dict[str, Any]]
    """The chat messages of the whole exchange, for a follow-up's previous_response_id."""
    stored_at: float
    num_bytes: int = 0
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    """The background generation, while it runs (cancel stops it)."""


class ResponseStore:
    def __init__(
        self,
        max_size: int = DEFAULT_RESPONSES_STORE_SIZE,
        ttl_s: float = DEFAULT_RESPONSES_STORE_TTL,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_STORE_BYTES,
    ) -> None:
        self.max_size, self.ttl_s, self._clock = max_size, ttl_s, clock
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> StoredResponse:
        """Store (or replace) a response; the oldest are dropped past the size or bytes."""
        self._expire()
        self.delete(body["id"])
        size = len(json.dumps(body, default=str)) + len(json.dumps(conversation, default=str))
        entry = StoredResponse(body, conversation, self._clock(), size)
        self._items[body["id"]] = entry
        self.num_bytes += size
        while self._items and (len(self._items) > self.max_size or self.num_bytes > self.max_bytes):
            self._drop_oldest()
        return entry

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _drop_oldest(self) -> None:
        _, entry = self._items.popitem(last=False)
        self.num_bytes -= entry.num_bytes

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at > deadline:
                return
            self._drop_oldest()
