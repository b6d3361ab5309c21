"""The engine's KV-cache events over ZMQ, as vLLM publishes them (vLLM's ZmqEventPublisher), for
consumers such as llm-d's precise prefix-cache scorer.

Wire format (vLLM 0.32, vllm/distributed/kv_events.py): each batch is one multipart message
[topic, 8-byte big-endian sequence number, msgpack payload] on a PUB socket; the payload is the
msgspec encoding of `KVEventBatch` (an array [ts, events, data_parallel_rank]) whose events are
tagged maps ({"type": "BlockStored", ...}). A ROUTER socket on `replay_endpoint` answers a
request [8-byte start sequence] with every buffered batch from it on, then an end marker.

The hub hands each batch to `offer` on the event loop; a publisher thread encodes and sends.
The queue between them is bounded: when it is full the queued batches are dropped and the
whole cache is queued instead (an AllBlocksCleared, then every block), so the serving loop never
waits for the publisher.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from frontend_svc.kv_events.hub import BlocksRemoved, BlocksStored, KvEvent
from frontend_svc.kv_events.kv_events_config import KVEventsConfig, offset_endpoint_port
from splitserve_runtime.log_limits import RateLimitedLog

logger = logging.getLogger(__name__)
replay_log = RateLimitedLog(logger)
"""Malformed replay requests: any peer that reaches the replay socket can send them."""

MEDIUM_GPU = "GPU"
"""vLLM's name of the device tier, whatever the device."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_MAX_MESSAGE_BYTES = 1024
"""Largest message the replay socket reads (a request is an empty frame and 8 bytes): ZMQ
disconnects a peer that sends more before it is read into memory (zmq.MAXMSGSIZE)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV-cache events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


def to_vllm_events(events: list[KvEvent], block_size: int) -> list[VllmEvent]:
    """The hub's events as vLLM's structs (main attention group 0, device tier)."""
    converted: list[VllmEvent] = []
    for event in events:
        if isinstance(event, BlocksStored):
            extra: list[tuple[Any, ...] | None]
            if event.extra_keys is None:
                extra = [None] * len(event.block_hashes)
            else:  # vLLM's untagged order: the LoRA name, (identifier, offset) pairs, the salt
                extra = [
                    (
                        *((k.lora_name,) if k.lora_name else ()),
                        *k.multimodal,
                        *((k.cache_salt,) if k.cache_salt else ()),
                    )
                    or None
                    for k in event.extra_keys
                ]
            lora = event.extra_keys[0] if event.extra_keys else None
            converted.append(
                BlockStored(
                    block_hashes=event.block_hashes,
                    parent_block_hash=event.parent_block_hash,
                    token_ids=event.token_ids,
                    block_size=block_size,
                    lora_id=lora.lora_id if lora and lora.lora_name else None,
                    medium=MEDIUM_GPU,
                    lora_name=lora.lora_name if lora and lora.lora_name else None,
                    extra_keys=extra,
                    group_idx=0,
                )
            )
        elif isinstance(event, BlocksRemoved):
            converted.append(BlockRemoved(event.block_hashes, MEDIUM_GPU, group_idx=0))
        else:
            converted.append(AllBlocksCleared())
    return converted


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + replay ROUTER, fed from a bounded queue by the serving loop."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int, block_size: int) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.block_size = block_size
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank) or ""
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._binds = _is_bind_endpoint(self.endpoint)
        self._queue: queue.Queue[tuple[float, list[KvEvent]] | None] = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._open_sockets()
        except zmq.ZMQError as err:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise ValueError(
                f"--kv-events-config: cannot open the KV-event endpoints {self.endpoint} / "
                f"{self.replay_endpoint or '-'}: {err}"
            ) from None
        self.num_resyncs = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        # vLLM's rule: an endpoint without `*` (or `::`, ipc://, inproc://) is connected to
        where = "publishing KV-cache events on" if self._binds else "connecting to"
        logger.info("%s %s (KV-cache events; replay: %s)", where, self.endpoint,
                    self.replay_endpoint or "off")  # fmt: skip

    def _open_sockets(self) -> None:
        if self._binds:
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_MESSAGE_BYTES)
            self._replay.bind(self.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def offer(self, events: list[KvEvent]) -> bool:
        """Queue a batch (serving loop); False when the queue is full (nothing queued)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            return False
        return True

    def resync(self, batches: list[list[KvEvent]]) -> None:
        """Drop what is queued; queue the whole cache instead (serving loop)."""
        self.num_resyncs += 1
        logger.warning("the ZMQ KV-event publisher fell behind; publishing the whole cache again")
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        now = time.time()
        for batch in batches:
            self._queue.put_nowait((now, batch))

    def close(self, timeout: float = 1.0) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        sequence = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            if not events:
                continue
            try:
                batch = KVEventBatch(
                    ts, to_vllm_events(events, self.block_size), self.data_parallel_rank
                )
                payload = encode(batch)
                seq = next(sequence).to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((int.from_bytes(seq, "big"), payload))
            except Exception:  # one bad batch must not stop the publisher
                logger.exception("publishing a KV-event batch failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            replay_log.warning("replay", "invalid KV-event replay request (%d frames)", len(frames))
            return
        client_id, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
