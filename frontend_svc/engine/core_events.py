"""What the frontend's engine pulls from its link to the engine core (`CoreClient`: gRPC in
core_client.py, in-process in the hop benchmark): each step's outputs, KV-cache events, ping
round trips, refreshed scheduler stats, and the stream's breaks and reconnections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from frontend_svc.engine.engine_types import CoreOutputs
from frontend_svc.kv_events.hub import KvEvents
from frontend_svc.requests import EngineRequest
from splitserve_contracts.output_types import SchedulerStats


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The stream to the engine core broke; every request sent on it is lost."""

    reason: str


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """A ping's round trip to the engine core, in seconds of this process's clock."""

    seconds: float


@dataclass(frozen=True, slots=True)
class StatsRefresh:
    """The core's scheduler stats, fetched because no outputs brought them lately
    (core_client.STATS_MAX_AGE_S)."""

    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class Reconnected:
    """A new stream to the engine core is open after a break. `problem` is set when the core
    that answered serves something else than before (another model, vocabulary or context
    length): requests of the old one cannot continue there."""

    problem: str = ""


CoreEvent = CoreOutputs | KvEvents | Disconnected | Reconnected | RoundTrip | StatsRefresh


class CoreClient(Protocol):
    """What AsyncEngine needs from its link to the engine core (gRPC here; in-process in the
    hop benchmark)."""

    core_addr: str

    @property
    def is_connected(self) -> bool: ...

    def next_handle(self) -> int: ...

    async def next_event(self) -> CoreEvent:
        """The next event, in order; the caller calls `event_done` after handling it."""
        ...

    def event_done(self) -> None: ...

    def add_requests(self, requests: list[tuple[int, EngineRequest]]) -> None: ...

    def resubmit_requests(self, requests: list[tuple[int, EngineRequest]]) -> None: ...

    def abort_requests(self, handles: list[int]) -> None: ...

    async def close(self) -> None: ...
