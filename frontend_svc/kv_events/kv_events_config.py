"""vLLM's `--kv-events-config`: whether this frontend serves the engine's KV-cache events, and how
it publishes them over ZMQ.

The JSON keys, their defaults and meanings are vLLM's KVEventsConfig (vllm/config/kv_events.py):
`enable_kv_cache_events` turns the events on (the frontend subscribes to the engine core's and
serves them on the gateway contract's SubscribeKvEvents); `publisher` "zmq" (the default when
enabled, as in vLLM) also publishes them on `endpoint`, "null" serves them over gRPC only.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    """PUB address: bound when it holds a wildcard (`*`, `::`) or is ipc:// / inproc://, else
    connected to (vLLM's rule)."""
    replay_endpoint: str | None = None
    """ROUTER address where a subscriber asks for the batches it missed, from a sequence."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket (ZMQ drops for a subscriber past it)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past it they are dropped and the publisher
    sends the whole cache again (vLLM's publisher would block the engine instead)."""
    topic: str = ""

    @property
    def publishes_zmq(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """argparse type of --kv-events-config: a JSON object of KVEventsConfig's fields."""
    try:
        values: Any = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError(
            "must be a JSON object, e.g. '{\"enable_kv_cache_events\": true}'"
        )
    known = {f.name for f in fields(KVEventsConfig)}
    for key, value in values.items():
        if key not in known:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; known: {', '.join(sorted(known))}"
            )
        kinds = _TYPES[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise argparse.ArgumentTypeError(f"{key} has the wrong type ({type(value).__name__})")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in values and values[key] < 1:
            raise argparse.ArgumentTypeError(f"{key} must be >= 1")
    enabled = values.get("enable_kv_cache_events", False)
    publisher = values.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in PUBLISHERS:
        raise argparse.ArgumentTypeError(f"publisher must be one of {', '.join(PUBLISHERS)}")
    values["publisher"] = publisher
    return KVEventsConfig(**values)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's ZmqEventPublisher.offset_endpoint_port: rank r publishes on the base port + r
    (inproc endpoints get a `_dp<r>` suffix; port 0 is left to the OS)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or not port.isdigit():
            return endpoint
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")
